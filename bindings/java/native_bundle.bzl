"""native_bundle: the jar's native directory, self-contained (//tools:bundle_shared_libs.py says what goes in)."""

def _native_bundle_impl(ctx):
    out = ctx.actions.declare_directory(ctx.attr.dir)
    ctx.actions.run_shell(
        command = 'out="$1"; shift; /usr/bin/python3 "$@" > "$out/libs.txt.tmp" && mv "$out/libs.txt.tmp" "$out/libs.txt"',
        arguments = [out.path, ctx.file._script.path, out.path] + [f.path for f in ctx.files.libs],
        inputs = ctx.files.libs + [ctx.file._script],
        outputs = [out],
        mnemonic = "NativeBundle",
        progress_message = "bundling the native libraries of %s" % ctx.label,
        use_default_shell_env = True,
    )
    return [DefaultInfo(files = depset([out]))]

native_bundle = rule(
    implementation = _native_bundle_impl,
    doc = "A directory (tree artifact) with libs, every library they load beyond glibc/libstdc++/libgcc_s, " +
          "each with RUNPATH $ORIGIN, and libs.txt listing them.",
    attrs = {
        "dir": attr.string(mandatory = True, doc = "the directory's path below the package"),
        "libs": attr.label_list(allow_files = True, mandatory = True),
        "_script": attr.label(default = "//tools:bundle_shared_libs.py", allow_single_file = True),
    },
)
