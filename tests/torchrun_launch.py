"""torchrun launches from the tests, with every rank's own result checked.

torchrun exits non-zero when a rank fails, but a rank that returns early, or one whose output a test never
looks at, exits 0 like a rank that did its work; and a test that looks for "EP OK" in the combined output passes
on rank 0's line alone. So every launch goes through this file as a per-rank wrapper (``__main__`` below): each
rank runs the target script as ``python SCRIPT ARGS`` would and then prints ``RANK DONE rank=R``; workers mark
each case they finish with ``mark("EP OK random")`` (-> ``EP OK random rank=R``). ``assert_every_rank`` then
fails unless the launch exited 0 and every rank 0..nproc-1 printed the done marker and each expected marker.
Before the done marker (and before a failing script's exception goes on to interpreter shutdown) the wrapper
reports its live gloo worker threads (``gloo workers left: N rank=R``, Linux), which a test can require to be
0 (``NO_GLOO_LEFT``): threads left running into interpreter shutdown can abort a finished rank.
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DONE = "RANK DONE"
GLOO_LEFT = "gloo workers left:"  # reported with their count when the script ends (Linux)
# the markers of a launch whose every rank joined its gloo workers (none where they cannot be counted)
NO_GLOO_LEFT = (f"{GLOO_LEFT} 0",) if sys.platform.startswith("linux") else ()


def torchrun_env() -> dict:
    """The environment of a torchrun launch from the tests: this checkout first on the path, one thread, offline."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def torchrun(script, *args, nproc: int = 2, timeout: float = 300, env: dict | None = None,
             cwd=REPO) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node NPROC SCRIPT ARGS`` (through the per-rank wrapper), run to the end;
    -> the finished process, whatever its exit code (check it with ``assert_every_rank``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(Path(__file__)), str(script), *map(str, args)]
    return subprocess.run(cmd, check=False, env=env or torchrun_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def say(text: str) -> None:
    """Worker side: print ``TEXT`` as one line in one write. print() writes the text and the newline separately,
    and two ranks sharing the pipe could interleave between them ("EP OK rank=0EP OK rank=1")."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{text}\n".encode())


def mark(text: str) -> None:
    """Worker side: print ``TEXT rank=R`` (this process's global rank)."""
    say(f"{text} rank={os.environ.get('RANK', '0')}")


def ranks_with(output: str, text: str) -> set[int]:
    """The ranks that printed ``TEXT rank=R`` (one write, ``mark``) ending a line of ``output``: not anchored at the
    line start, since another rank's print() may have written its text and not yet its newline."""
    return {int(r) for r in re.findall(rf"{re.escape(text)} rank=(\d+)$", output, flags=re.MULTILINE)}


def gloo_workers() -> int | None:
    """This process's live gloo worker threads (torch names them pt_gloo_runloop); None where /proc has no
    thread list."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    count = 0
    for task in tasks.iterdir():
        try:
            count += (task / "comm").read_text().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            pass
    return count


def tail(result: subprocess.CompletedProcess) -> str:
    return f"exit code {result.returncode}\n--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-6000:]}"


def missing_ranks(output: str, text: str, nproc: int) -> list[int]:
    return sorted(set(range(nproc)) - ranks_with(output, text))


def assert_every_rank(result: subprocess.CompletedProcess, nproc: int, *markers: str) -> None:
    """The launch exited 0 and every rank printed ``RANK DONE`` and each of ``markers`` (``mark``)."""
    assert result.returncode == 0, f"torchrun failed: {tail(result)}"
    for text in (DONE, *markers):
        missing = missing_ranks(result.stdout, text, nproc)
        assert not missing, f"rank(s) {missing} of {nproc} did not report {text!r}: {tail(result)}"


def _run_as_rank() -> None:
    """Run ``sys.argv[1]`` with the remaining arguments as ``python SCRIPT ARGS`` would, then report done."""
    script = Path(sys.argv[1]).resolve()
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path[0] = str(script.parent)
    real_exit = os._exit

    def report_gloo_workers():
        left = gloo_workers()
        if left is not None:
            mark(f"{GLOO_LEFT} {left}")

    def exit_reporting(code):  # a worker may skip interpreter teardown with os._exit(0) after its checks
        if code == 0:
            report_gloo_workers()
            mark(DONE)
        real_exit(code)

    os._exit = exit_reporting
    try:
        runpy.run_path(str(script), run_name="__main__")
    except BaseException as stop:
        if not isinstance(stop, SystemExit) or stop.code not in (None, 0):
            report_gloo_workers()  # with the exception still alive, as it will be in interpreter shutdown
            raise
    report_gloo_workers()
    mark(DONE)


if __name__ == "__main__":
    _run_as_rank()
