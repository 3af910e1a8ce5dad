"""`seqgrad <tool> [flags]`: the command-line tools, the same programs the source tree builds, from the package.

    seqgrad train --model=demo --strategy=seco      # also plan, score, bench, gradcheck (each tool's --help)
    seqgrad data --tokenizer DIR --input chats.jsonl --output train.jsonl   # python -m seqgrad.data

The tools are executables in the package's bin/ directory; `seqgrad <tool>` replaces this process with the tool, so
its flags, output and exit code are the tool's own.
"""
import os
import sys

TOOLS = ("train", "plan", "score", "bench", "gradcheck")
_USAGE = "usage: seqgrad {%s|data} [flags]   (seqgrad <tool> --help lists a tool's flags)" % "|".join(TOOLS)


def tool_path(name):
    """The executable of one of TOOLS inside the installed package."""
    if name not in TOOLS:
        raise ValueError("seqgrad has no tool %r; the tools are %s" % (name, ", ".join(TOOLS)))
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", name)
    if not os.access(path, os.X_OK):
        raise FileNotFoundError("%s: the seqgrad package has no executable %s tool (a broken install?)" % (path, name))
    return path


def _bench_defaults(args):
    """bench compares against PyTorch with this interpreter and the packaged script, unless told otherwise."""
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    extra = []
    if "--python" not in given:
        extra.append("--python=" + sys.executable)
    if "--torch_script" not in given:
        extra.append("--torch_script=" + os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_torch.py"))
    return extra + args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_USAGE)
        return 0 if argv else 2
    tool, args = argv[0], argv[1:]
    if tool == "data":
        from . import data
        return data.main(args)
    if tool not in TOOLS:
        print("seqgrad: unknown tool %r\n%s" % (tool, _USAGE), file=sys.stderr)
        return 2
    if tool == "bench":
        args = _bench_defaults(args)
    path = tool_path(tool)
    package = os.path.dirname(os.path.abspath(__file__))
    plugin = os.path.join(package, "libseqgrad_mpi.so")  # --dist=mpi, --tp: the wheel's plug-in, unless one is named
    if "SEQGRAD_MPI_PLUGIN" not in os.environ and os.path.exists(plugin):
        os.environ["SEQGRAD_MPI_PLUGIN"] = plugin
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(path, [path] + args)


if __name__ == "__main__":
    sys.exit(main())
