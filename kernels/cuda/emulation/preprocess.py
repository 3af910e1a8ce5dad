#!/usr/bin/env python3
"""Turns CUDA sources (.cu / .cuh) into C++ for the CPU emulation (see include/sg_emu.h).

    preprocess.py --out_dir DIR --include_prefix kernels/cuda/emulation/gen --rewrite_include kernels/cuda/ \
        kernels/cuda/gemm.cu kernels/cuda/common.cuh ...

For each input X.cu writes DIR/X.cu.cc, for X.cuh writes DIR/X.cuh.h, with these rewrites (everything else,
line numbers included, is kept; a #line directive makes diagnostics name the original file):

  * kernel<<<grid, block[, smem[, stream]]>>>(args);      (kernel: a name, optionally qualified and with template
                                                           arguments; any spacing and line breaks)
      -> ::sg_emu::Launch("kernel", "file:line", grid, block, smem, stream, max_threads, kernel, args);
    max_threads is the kernel's __launch_bounds__ expression when the same file declares one, else 0.
  * extern __shared__ [__align__(n)] T name[];
      -> T* name = static_cast<T*>(::sg_emu::DynamicShared());
  * __shared__ T name[N]...;
      -> static thread_local T name[N]...; ::sg_emu::StaticShared(&name, sizeof(name));
  * #include "<rewrite_include>X.cuh" -> #include "<include_prefix>/X.cuh.h" (the headers are rewritten too).

Comments and string literals are never rewritten. Exits non-zero, naming file and line, on a launch it cannot
parse.
"""

import argparse
import os
import re
import sys


class ParseError(Exception):
    pass


def mask_comments_and_strings(text):
    """The text with comments, string and character literals replaced by spaces (newlines kept)."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
        elif c == 'R' and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^()\\ ]{0,16})\(', text[i:])
            if not m:
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and (text[i - 1].isalnum()) and i + 1 < n and text[i + 1].isalnum():
                i += 1  # digit separator (1'000)
                continue
            j = i + 1
            while j < n and text[j] != c:
                if text[j] == "\\":
                    j += 1
                elif text[j] == "\n":
                    break
                j += 1
            j = min(j + 1, n)
            for k in range(i + 1, j - 1):
                out[k] = " "
            i = j
        else:
            i += 1
    return "".join(out)


OPEN = {"(": ")", "[": "]", "{": "}"}
CLOSE = {")", "]", "}"}


def match_forward(masked, i):
    """Index just past the bracket closing the one at masked[i]."""
    stack = []
    n = len(masked)
    while i < n:
        c = masked[i]
        if c in OPEN:
            stack.append(OPEN[c])
        elif c in CLOSE:
            if not stack or stack.pop() != c:
                raise ParseError("unbalanced brackets")
            if not stack:
                return i + 1
        i += 1
    raise ParseError("unterminated bracket")


def split_top_level(masked_part, text_part):
    """Splits text_part at the commas that are outside brackets (positions found on masked_part)."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(masked_part):
        if c in OPEN:
            depth += 1
        elif c in CLOSE:
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text_part[start:i])
            start = i + 1
    parts.append(text_part[start:])
    return parts


def kernel_start(masked, end):
    """Start of the kernel expression that ends right before masked[end] (the first '<' of '<<<')."""
    i = end - 1
    while i >= 0 and masked[i].isspace():
        i -= 1
    if i >= 0 and masked[i] == ">":  # template arguments: back to the matching '<'
        depth = 0
        while i >= 0:
            c = masked[i]
            if c in ">)]":
                depth += 1
            elif c in "<([":
                depth -= 1
                if depth == 0:
                    break
            i -= 1
        if i < 0:
            raise ParseError("unbalanced template arguments before <<<")
        i -= 1
        while i >= 0 and masked[i].isspace():
            i -= 1
    j = i
    while j >= 0 and (masked[j].isalnum() or masked[j] in "_:"):
        j -= 1
    if j == i:
        raise ParseError("no kernel name before <<<")
    return j + 1


def find_launch_bounds(masked, text):
    """{kernel name: __launch_bounds__ expression (its first argument)} of the file."""
    bounds = {}
    for m in re.finditer(r"__launch_bounds__\s*\(", masked):
        close = match_forward(masked, m.end() - 1)
        args = split_top_level(masked[m.end():close - 1], text[m.end():close - 1])
        after = re.match(r"\s*([A-Za-z_]\w*)\s*\(", masked[close:])
        if after:
            bounds[after.group(1)] = " ".join(args[0].split())
    return bounds


def line_of(text, pos):
    return text.count("\n", 0, pos) + 1


def rewrite(text, display_name, include_prefix, rewrite_include):
    masked = mask_comments_and_strings(text)
    bounds = find_launch_bounds(masked, text)
    edits = []  # (start, end, replacement)

    for m in re.finditer(r"<<<", masked):
        start_cfg = m.end()
        try:
            # The configuration: up to the first '>>>' outside brackets.
            i, depth = start_cfg, 0
            while i < len(masked):
                c = masked[i]
                if c in OPEN:
                    depth += 1
                elif c in CLOSE:
                    depth -= 1
                elif depth == 0 and masked.startswith(">>>", i):
                    break
                i += 1
            else:
                raise ParseError("no >>> after <<<")
            end_cfg = i
            cfg = [" ".join(p.replace("\\\n", " ").split())
                   for p in split_top_level(masked[start_cfg:end_cfg], text[start_cfg:end_cfg])]
            if not 2 <= len(cfg) <= 4 or not all(cfg):
                raise ParseError("launch configuration needs 2 to 4 arguments, got %r" % (cfg,))
            while len(cfg) < 4:
                cfg.append("0")
            j = end_cfg + 3
            while j < len(masked) and masked[j].isspace():
                j += 1
            if j >= len(masked) or masked[j] != "(":
                raise ParseError("no argument list after >>>")
            args_end = match_forward(masked, j)
            args = text[j + 1:args_end - 1]
            k_start = kernel_start(masked, m.start())
        except ParseError as e:
            raise ParseError("%s:%d: cannot parse kernel launch: %s" % (display_name, line_of(text, m.start()), e))
        kernel = text[k_start:m.start()].rstrip()
        kernel_flat = " ".join(kernel.split())
        base = re.match(r"[\w:]*", kernel_flat).group(0).split("::")[-1]
        max_threads = "(%s)" % bounds[base] if base in bounds else "0"
        where = "%s:%d" % (display_name, line_of(text, m.start()))
        repl = '::sg_emu::Launch("%s", "%s", %s, %s, %s, %s, %s, %s' % (
            kernel_flat.replace("\\", "\\\\").replace('"', '\\"'), where, cfg[0], cfg[1], cfg[2], cfg[3],
            max_threads, kernel)
        if args.strip():
            repl += ", " + args
        repl += ")"
        original = text[k_start:args_end]
        if "\\\n" not in original:  # keep the line count (not inside a macro's continued lines)
            repl += "\n" * max(0, original.count("\n") - repl.count("\n"))
        edits.append((k_start, args_end, repl))

    for m in re.finditer(r"\bextern\s+__shared__\b([^;\[]*?)\b([A-Za-z_]\w*)\s*\[\s*\]\s*;", masked):
        decl = text[m.start(1):m.end(1)]
        decl = re.sub(r"__align__\s*\(\s*\w+\s*\)|alignas\s*\(\s*\w+\s*\)|__attribute__\s*\(\(.*?\)\)", " ", decl)
        type_ = " ".join(decl.split())
        if not type_:
            raise ParseError("%s:%d: extern __shared__ without a type" % (display_name, line_of(text, m.start())))
        name = m.group(2)
        repl = "%s* %s = static_cast<%s*>(::sg_emu::DynamicShared());" % (type_, name, type_)
        repl += "\n" * max(0, text[m.start():m.end()].count("\n"))
        edits.append((m.start(), m.end(), repl))

    # Static shared variables: static thread_local (see sg_emu.h), filled with NaN at each block's start by the
    # first thread that reaches the declaration.
    for m in re.finditer(r"\b__shared__\s+([^;{}]*?)\b([A-Za-z_]\w*)\s*((?:\[[^\];]*\]\s*)*);", masked):
        if re.search(r"\bextern\s*$", masked[max(0, m.start() - 40):m.start()]):
            continue
        type_ = " ".join(text[m.start(1):m.end(1)].split())
        name = m.group(2)
        dims = " ".join(text[m.start(3):m.end(3)].split())
        if not type_:
            raise ParseError("%s:%d: __shared__ without a type" % (display_name, line_of(text, m.start())))
        repl = "static thread_local %s %s%s; ::sg_emu::StaticShared(&%s, sizeof(%s));" % (type_, name, dims, name, name)
        repl += "\n" * text[m.start():m.end()].count("\n")
        edits.append((m.start(), m.end(), repl))

    if rewrite_include:
        pat = r'#\s*include\s*"%s([\w./-]+)\.cuh"' % re.escape(rewrite_include)
        for m in re.finditer(pat, masked_includes(text, masked)):
            edits.append((m.start(), m.end(), '#include "%s/%s.cuh.h"' % (include_prefix, m.group(1))))

    edits.sort()
    for a, b in zip(edits, edits[1:]):
        if a[1] > b[0]:
            raise ParseError("%s:%d: overlapping rewrites" % (display_name, line_of(text, b[0])))
    out, pos = [], 0
    for s, e, r in edits:
        out.append(text[pos:s])
        out.append(r)
        pos = e
    out.append(text[pos:])
    return "".join(out)


def masked_includes(text, masked):
    """The masked text with the quoted file names of #include lines restored (they are string literals)."""
    out = list(masked)
    for m in re.finditer(r'#\s*include\s*"[^"\n]*"', text):
        if masked[m.start()] == "#":
            out[m.start():m.end()] = text[m.start():m.end()]
    return "".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", required=True)
    p.add_argument("--include_prefix", required=True, help="include path of out_dir")
    p.add_argument("--rewrite_include", default="kernels/cuda/",
                   help='"#include "<this>X.cuh"" lines are pointed at the rewritten headers')
    p.add_argument("srcs", nargs="+")
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    for src in a.srcs:
        with open(src, encoding="utf-8") as f:
            text = f.read()
        base = os.path.basename(src)
        if base.endswith(".cu"):
            out_name = base + ".cc"
        elif base.endswith(".cuh"):
            out_name = base + ".h"
        else:
            sys.exit("preprocess.py: %s is neither .cu nor .cuh" % src)
        display = src
        # Bazel passes paths like bazel-out/.../kernels/cuda/x.cu for generated inputs; sources are repo-relative.
        try:
            body = rewrite(text, display, a.include_prefix, a.rewrite_include)
        except ParseError as e:
            sys.exit("preprocess.py: %s" % e)
        header = "// Generated by kernels/cuda/emulation/preprocess.py from %s: do not edit.\n" % src
        header += "#include <cuda_runtime.h>\n"
        header += '#line 1 "%s"\n' % src
        with open(os.path.join(a.out_dir, out_name), "w", encoding="utf-8") as f:
            f.write(header + body)


if __name__ == "__main__":
    main()
