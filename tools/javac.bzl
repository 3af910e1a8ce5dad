"""Java without the network: java_jar (javac + jar of the local JDK), java_doc (javadoc jar) and junit5_test.

Bazel 4.2.3's native java_library/java_test need the downloaded java_tools, which this
project cannot fetch. These rules call the local JDK (@local_jdk//:jdk, i.e.
/usr/lib/jvm/java-17-openjdk-amd64) directly.

    load("//tools:javac.bzl", "java_jar", "junit5_test")

    java_jar(
        name = "seqgrad_java",
        srcs = glob(["src/main/java/**/*.java"]),
        resources = glob(["src/main/resources/**"]),  # files or directories (tree artifacts)
        resource_strip_prefix = "src/main/resources",
        deps = [":other_jar", "//some:file.jar"],
        out = "seqgrad-1.0.jar",                         # default: <name>.jar
        manifest_entries = {"Implementation-Version": "1.0"},
    )

    java_doc(
        name = "seqgrad_javadoc",
        srcs = glob(["src/main/java/**/*.java"]),
        javadocopts = ["-Xdoclint:all"],
    )

    junit5_test(
        name = "seqgrad_java_test",
        srcs = glob(["src/test/java/**/*.java"]),
        deps = [":seqgrad_java"],
        jvm_flags = ["-Dseqgrad.lib=$(rootpath //java/native:libseqgrad_jni.so)"],
        data = ["//java/native:libseqgrad_jni.so"],
    )
"""

JavaJarInfo = provider(
    doc = "A jar built by java_jar and the jars it needs at run time.",
    fields = {
        "jar": "File: this target's jar",
        "transitive_jars": "depset of File: this jar and all jars of its deps",
    },
)

def _jars_of(dep):
    if JavaJarInfo in dep:
        return dep[JavaJarInfo].transitive_jars
    return depset([f for f in dep[DefaultInfo].files.to_list() if f.extension == "jar"])

def _resource_path(ctx, f):
    path = f.short_path
    prefix = ctx.attr.resource_strip_prefix
    if not prefix:
        prefix = ctx.label.package
    elif ctx.label.package:
        prefix = ctx.label.package + "/" + prefix
    if prefix and path.startswith(prefix + "/"):
        return path[len(prefix) + 1:]
    return path

def _java_jar_impl(ctx):
    jdk = ctx.attr._jdk[java_common.JavaRuntimeInfo]
    out = ctx.actions.declare_file(ctx.attr.out or ctx.label.name + ".jar")
    dep_jars = depset(transitive = [_jars_of(d) for d in ctx.attr.deps])
    classpath = ":".join([j.path for j in dep_jars.to_list()])

    # Sources and resources go through files, so long lists never hit ARG_MAX.
    srcs_list = ctx.actions.declare_file(ctx.label.name + "_srcs.txt")
    src_lines = [f.path for f in ctx.files.srcs]
    ctx.actions.write(srcs_list, "\n".join(src_lines) + ("\n" if src_lines else ""))
    res_lines = ["%s\t%s" % (f.path, _resource_path(ctx, f)) for f in ctx.files.resources]
    res_list = ctx.actions.declare_file(ctx.label.name + "_resources.txt")
    ctx.actions.write(res_list, "\n".join(res_lines) + ("\n" if res_lines else ""))

    manifest = ctx.actions.declare_file(ctx.label.name + "_manifest.txt")
    ctx.actions.write(manifest, "".join(["%s: %s\n" % kv for kv in sorted(ctx.attr.manifest_entries.items())]))
    jar_flags = "cfme" if ctx.attr.main_class else "cfm"
    jar_main = (" " + _shell_quote(ctx.attr.main_class)) if ctx.attr.main_class else ""
    command = """
set -euo pipefail
JAVA_HOME="{java_home}"
work="$(mktemp -d "${{TMPDIR:-/tmp}}/java_jar.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/classes"
if [ -s "{srcs_list}" ]; then
  "$JAVA_HOME/bin/javac" -nowarn -encoding UTF-8 -d "$work/classes" \\
    -cp "{classpath}" {javacopts} @"{srcs_list}"
fi
while IFS=$'\\t' read -r src dst; do
  [ -n "$src" ] || continue
  mkdir -p "$work/classes/$(dirname "$dst")"
  if [ -d "$src" ]; then
    mkdir -p "$work/classes/$dst" && cp -R "$src/." "$work/classes/$dst/"
  else
    cp "$src" "$work/classes/$dst"
  fi
done < "{res_list}"
"$JAVA_HOME/bin/jar" {jar_flags} "$PWD/{out}" "{manifest}"{jar_main} -C "$work/classes" .
""".format(
        java_home = jdk.java_home,
        srcs_list = srcs_list.path,
        res_list = res_list.path,
        classpath = classpath,
        javacopts = " ".join([_shell_quote(o) for o in ctx.attr.javacopts]),
        jar_flags = jar_flags,
        manifest = manifest.path,
        jar_main = jar_main,
        out = out.path,
    )
    ctx.actions.run_shell(
        command = command,
        inputs = depset(
            ctx.files.srcs + ctx.files.resources + [srcs_list, res_list, manifest],
            transitive = [dep_jars, jdk.files],
        ),
        outputs = [out],
        mnemonic = "JavaJar",
        progress_message = "javac+jar %s" % out.short_path,
        use_default_shell_env = True,
    )

    transitive_jars = depset([out], transitive = [dep_jars])
    runfiles = ctx.runfiles(files = [out], transitive_files = dep_jars)
    for d in ctx.attr.deps + ctx.attr.data:
        runfiles = runfiles.merge(d[DefaultInfo].default_runfiles)
    runfiles = runfiles.merge(ctx.runfiles(files = ctx.files.data))
    return [
        DefaultInfo(files = depset([out]), runfiles = runfiles),
        JavaJarInfo(jar = out, transitive_jars = transitive_jars),
        OutputGroupInfo(runtime_jars = transitive_jars),
    ]

def _shell_quote(s):
    return "'" + s.replace("'", "'\\''") + "'"

java_jar = rule(
    implementation = _java_jar_impl,
    doc = "Compiles srcs with the local JDK's javac and packs classes + resources into <name>.jar.",
    attrs = {
        "srcs": attr.label_list(allow_files = [".java"]),
        "deps": attr.label_list(
            allow_files = [".jar"],
            doc = "java_jar targets or .jar files: compile classpath, and run-time classpath of dependents",
        ),
        "resources": attr.label_list(allow_files = True),
        "resource_strip_prefix": attr.string(
            doc = "Path below the package stripped from resource paths (default: the package itself)",
        ),
        "data": attr.label_list(allow_files = True, doc = "Run-time files (runfiles)"),
        "javacopts": attr.string_list(),
        "main_class": attr.string(doc = "Main-Class of the jar manifest"),
        "manifest_entries": attr.string_dict(doc = "Main attributes of the jar manifest"),
        "out": attr.string(doc = "The jar's file name (default: <name>.jar)"),
        "_jdk": attr.label(
            default = Label("@local_jdk//:jdk"),
            providers = [java_common.JavaRuntimeInfo],
        ),
    },
)

def _java_doc_impl(ctx):
    jdk = ctx.attr._jdk[java_common.JavaRuntimeInfo]
    out = ctx.actions.declare_file(ctx.attr.out or ctx.label.name + ".jar")
    dep_jars = depset(transitive = [_jars_of(d) for d in ctx.attr.deps])
    srcs_list = ctx.actions.declare_file(ctx.label.name + "_srcs.txt")
    ctx.actions.write(srcs_list, "".join([f.path + "\n" for f in ctx.files.srcs]))
    command = """
set -euo pipefail
work="$(mktemp -d "${{TMPDIR:-/tmp}}/java_doc.XXXXXX")"
trap 'rm -rf "$work"' EXIT
"{java_home}/bin/javadoc" -quiet -encoding UTF-8 -d "$work/html" -cp "{classpath}" {opts} @"{srcs_list}"
"{java_home}/bin/jar" cf "$PWD/{out}" -C "$work/html" .
""".format(
        java_home = jdk.java_home,
        classpath = ":".join([j.path for j in dep_jars.to_list()]),
        opts = " ".join([_shell_quote(o) for o in ctx.attr.javadocopts]),
        srcs_list = srcs_list.path,
        out = out.path,
    )
    ctx.actions.run_shell(
        command = command,
        inputs = depset(ctx.files.srcs + [srcs_list], transitive = [dep_jars, jdk.files]),
        outputs = [out],
        mnemonic = "JavaDoc",
        progress_message = "javadoc %s" % out.short_path,
        use_default_shell_env = True,
    )
    return [DefaultInfo(files = depset([out]))]

java_doc = rule(
    implementation = _java_doc_impl,
    doc = "Runs the local JDK's javadoc over srcs (failing on its errors) and jars the HTML into <name>.jar.",
    attrs = {
        "srcs": attr.label_list(allow_files = [".java"]),
        "deps": attr.label_list(allow_files = [".jar"], doc = "java_jar targets or .jar files on the classpath"),
        "javadocopts": attr.string_list(doc = "e.g. -Xdoclint:all -Werror"),
        "out": attr.string(doc = "The jar's file name (default: <name>.jar)"),
        "_jdk": attr.label(
            default = Label("@local_jdk//:jdk"),
            providers = [java_common.JavaRuntimeInfo],
        ),
    },
)

def junit5_test(
        name,
        srcs,
        deps = [],
        jvm_flags = [],
        data = [],
        resources = [],
        javacopts = [],
        **kwargs):
    """Compiles JUnit 5 tests and runs them with the JUnit console launcher in an sh_test.

    All test classes found on the test jar's classpath are run (--scan-class-path); the test
    fails if no test is found (--fail-if-no-tests). Reports land in the test's undeclared
    outputs (bazel-testlogs/<pkg>/<name>/test.outputs/).

    Args:
      name: test name.
      srcs: test .java files (org.junit.jupiter.api.* is on the classpath).
      deps: java_jar targets or .jar files under test.
      jvm_flags: JVM flags; $(location)/$(rootpath) are expanded (label must be in data).
        Paths are relative to the runfiles root, i.e. the test's working directory.
      data: run-time files (native libraries, test data).
      resources: test resources, put into the test jar.
      javacopts: extra javac flags.
      **kwargs: size, tags, timeout, flaky, visibility, ... for the sh_test.
    """
    lib = name + "_testlib"
    cp = name + "_classpath"
    java_jar(
        name = lib,
        srcs = srcs,
        deps = deps + ["@local_junit5//:jupiter_api"],
        resources = resources,
        javacopts = javacopts,
        testonly = True,
        visibility = ["//visibility:private"],
    )
    native.filegroup(
        name = cp,
        srcs = [":" + lib],
        output_group = "runtime_jars",
        testonly = True,
        visibility = ["//visibility:private"],
    )
    native.sh_test(
        name = name,
        srcs = ["//tools:junit5_runner.sh"],
        args = [
            "$(JAVA)",
            "$(rootpath @local_junit5//:console_standalone)",
        ] + ["--jvm_flag=" + f for f in jvm_flags] + [
            "--",
            "$(rootpaths :%s)" % cp,
        ],
        data = [
            ":" + cp,
            "@local_jdk//:jdk",
            "@local_junit5//:console_standalone",
        ] + data,
        toolchains = ["@local_jdk//:jdk"],
        **kwargs
    )
