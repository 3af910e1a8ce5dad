"""python_headers(name, version): one CPython's C API headers and interpreter, for building and testing the wheel of
that version. Looks in Debian's /usr/include/pythonX.Y, then in pyenv's versions (PYENV_ROOT, else ~/.pyenv; the
newest patch release of X.Y). The repository has :python_headers and defs.bzl, whose PYTHON is the interpreter."""

def _python_headers_impl(rctx):
    v = rctx.attr.version
    pyenv = rctx.os.environ.get("PYENV_ROOT", rctx.os.environ.get("HOME", "/root") + "/.pyenv")
    found = []
    if rctx.path("/usr/include/python%s/Python.h" % v).exists and rctx.path("/usr/bin/python" + v).exists:
        found.append(("/usr/include/python" + v, "/usr/bin/python" + v))
    listing = rctx.execute(["/bin/sh", "-c", "ls -d '%s'/versions/%s.* 2>/dev/null | sort -V -r" % (pyenv, v)])
    for prefix in listing.stdout.splitlines():
        include = "%s/include/python%s" % (prefix, v)
        if rctx.path(include + "/Python.h").exists and rctx.path("%s/bin/python%s" % (prefix, v)).exists:
            found.append((include, "%s/bin/python%s" % (prefix, v)))
    if not found:
        fail("CPython %s: no headers in /usr/include/python%s or %s/versions/%s.*/include (install python%s-dev, " %
             (v, v, pyenv, v, v) + "or that version with pyenv)")
    include, python = found[0]
    rctx.symlink(include, "include")
    rctx.file("BUILD", """package(default_visibility = ["//visibility:public"])

cc_library(
    name = "python_headers",
    hdrs = glob(["include/**/*.h"]),
    includes = ["include"],
)
""")
    rctx.file("defs.bzl", 'PYTHON = "%s"\n' % python)

python_headers = repository_rule(
    implementation = _python_headers_impl,
    attrs = {"version": attr.string(mandatory = True)},
    environ = ["PYENV_ROOT", "HOME"],
    local = True,
)
