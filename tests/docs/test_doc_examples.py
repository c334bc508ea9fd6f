"""Every code example of the user-facing pages runs, as written.

A fenced ``python`` block in docs/ is marked by the HTML comment on the line before it
(invisible on the site):

- ``<!-- run -->``: a program of its own, run in one process, no process group;
- ``<!-- run: 2 ranks -->``: a program run on 2 gloo ranks as ``torchrun --nproc-per-node 2``
  would start it (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` set; the program
  calls ``init_process_group`` itself);
- ``<!-- run: continue -->``: appended to the page's previous program, which then runs with it;
- ``<!-- not run: why -->``: shown only (a placeholder path, a cluster, an installed MindSpore).

Pages a user follows (getting started, guides, interoperability) may not have an unmarked
python block. Each program runs in a fresh, empty working directory, so examples use relative
paths. The one-process programs run inside this test process (the package is imported once);
2-rank ones through tests/multiprocess.py.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from multiprocess import run_ranks

DOCS = Path(__file__).resolve().parents[2] / "docs"
CHECKED = ["getting-started.md", "guides", "interop"]

FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.M | re.S)
MARK = re.compile(r"<!--\s*(run(?::\s*(?P<mode>2 ranks|continue))?|not run:[^>]*)\s*-->\s*$")


@dataclass
class Program:
    page: str
    line: int
    ranks: int
    blocks: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def code(self) -> str:
        return "\n".join(self.blocks)


def pages() -> list[Path]:
    out: list[Path] = []
    for entry in CHECKED:
        p = DOCS / entry
        out += sorted(p.rglob("*.md")) if p.is_dir() else [p]
    return out


def parse(page: Path) -> tuple[list[Program], list[str]]:
    """The page's programs, and its python blocks that carry no mark (``page:line``)."""
    text = page.read_text(encoding="utf-8")
    rel = page.relative_to(DOCS).as_posix()
    programs: list[Program] = []
    unmarked: list[str] = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        if mark is None:
            unmarked.append(f"{rel}:{line}")
            continue
        if mark.group(1).startswith("not run"):
            continue
        mode = mark.group("mode")
        if mode == "continue":
            assert programs, f"{rel}:{line}: 'run: continue' with no program before it"
            programs[-1].blocks.append(m.group(1))
        else:
            programs.append(Program(rel, line, 2 if mode == "2 ranks" else 1, [m.group(1)]))
    return programs, unmarked


ALL = [prog for page in pages() for prog in parse(page)[0]]


def test_every_example_is_marked():
    """A new example is either run here or says why it cannot be."""
    unmarked = [u for page in pages() for u in parse(page)[1]]
    assert not unmarked, ("python blocks without <!-- run --> or <!-- not run: why -->: "
                          + ", ".join(unmarked))
    assert len(ALL) >= 15, f"only {len(ALL)} runnable examples found"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, ws: int, code: str, name: str, workdir: str, port: int) -> None:
    """Run ``code`` as a torchrun-started script would: env set, no process group yet."""
    import torch.distributed as dist

    dist.destroy_process_group()  # the launcher's; the example makes its own
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ws),
                      LOCAL_WORLD_SIZE=str(ws), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.chdir(workdir)
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("prog", ALL, ids=[p.id for p in ALL])
def test_example_runs(prog: Program, tmp_path, monkeypatch):
    name = f"docs/{prog.id}"
    if prog.ranks == 1:
        monkeypatch.chdir(tmp_path)
        exec(compile(prog.code, name, "exec"), {"__name__": "__main__"})
    else:
        run_ranks(_rank_main, prog.ranks, prog.code, name, str(tmp_path), _free_port(), timeout_s=180)
