"""Writing one claim's section of bench/RESULTS.md from a run's JSON: the scripts that
build a section (bench/gpu/offload_section.py, bench/replay_section.py) share this."""
import re
import sys


def split_write(argv):
    """The script's arguments `argv` (without the program name) less `--write PATH`, and
    PATH (None without --write)."""
    args = [a for a in argv if a != "--write"]
    write = None
    if "--write" in argv:
        write = argv[argv.index("--write") + 1]
        args.remove(write)
    return args, write


def emit(write, heading, claim, anchor, goal, text, summary):
    """Print the section (summary on stderr), or with `write` a RESULTS.md path: replace
    the section under `heading` by `text` and the claim's summary row by goal | summary."""
    if not write:
        print(text)
        print(summary, file=sys.stderr)
        return
    with open(write) as f:
        page = f.read()
    start = page.index(heading)
    end = page.index("\n## ", start + len(heading))
    page = page[:start] + text + page[end:]
    page = re.sub(
        r"^(\| \[" + re.escape(claim) + r"\]" + re.escape(anchor) + r" \| )[^|]*\|[^|]*\|$",
        lambda m: m.group(1) + f"{goal} | {summary} |",
        page, count=1, flags=re.M)
    with open(write, "w") as f:
        f.write(page)
