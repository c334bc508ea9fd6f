"""The import swap and the counting of scripts/torch_suite.py, on synthetic test files.

The runner measures torch's own DCP tests against ours; what it reports is only as good as the
rewrite (which names move to hyper_parallel, which stay torch's) and the counting rules (only
stock passes count; a file failing at import fails all of its tests). Both are checked here on
small files written by the test, so nothing outside this repository is needed.
"""

import ast
import importlib.util
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("torch_suite", ROOT / "scripts" / "torch_suite.py")
torch_suite = importlib.util.module_from_spec(spec)
sys.modules["torch_suite"] = torch_suite
spec.loader.exec_module(torch_suite)

OURS = "hyper_parallel.core.distributed_checkpoint"

SNIPPET = textwrap.dedent('''
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.state_dict_saver as saver
    import torch.distributed.checkpoint._traverse as _traverse
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.utils import _DistWrapper, find_state_dict_object
    from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
    from torch.distributed.checkpoint._experimental.types import RankInfo
    from torch.distributed import checkpoint as dist_cp
    from torch.testing._internal.distributed.checkpoint_utils import with_temp_dir
    from unittest.mock import patch

    @patch("torch.distributed.checkpoint.filesystem.os.fsync")
    def f(m):
        return torch.distributed.checkpoint.save, torch.distributed.checkpoint._traverse
    TARGET = "torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter"
    NOT_DCP = "mytorch.distributed.checkpoint"
''')


def test_public_module_and_names_move_to_ours():
    out, n = torch_suite.swap_source(SNIPPET, private={"_traverse", "_hf_utils", "_experimental",
                                                      "_fsspec_filesystem"})
    assert f"import {OURS} as dcp\n" in out
    assert f"import {OURS}\n" in out
    assert f"import {OURS}.state_dict_saver as saver\n" in out
    assert f"from {OURS} import FileSystemReader, load\n" in out
    # a private name imported from a public submodule moves with its module
    assert f"from {OURS}.utils import _DistWrapper, find_state_dict_object\n" in out
    # mock.patch targets and attribute uses are rewritten like imports
    assert f'@patch("{OURS}.filesystem.os.fsync")' in out
    assert f"return {OURS}.save, " in out
    # `from torch.distributed import checkpoint` binds the package too
    assert "from hyper_parallel.core import distributed_checkpoint as dist_cp\n" in out
    assert n == 8
    ast.parse(out)


def test_private_submodules_and_lookalikes_stay_torch():
    out, _ = torch_suite.swap_source(SNIPPET, private={"_traverse", "_hf_utils", "_experimental",
                                                      "_fsspec_filesystem"})
    assert "import torch.distributed.checkpoint._traverse as _traverse\n" in out
    assert "from torch.distributed.checkpoint._hf_utils import _HFStorageInfo\n" in out
    assert "from torch.distributed.checkpoint._experimental.types import RankInfo\n" in out
    assert "torch.distributed.checkpoint._traverse\n" in out  # attribute path to a private module
    assert '"torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter"' in out
    assert "from torch.testing._internal.distributed.checkpoint_utils import with_temp_dir" in out
    assert '"mytorch.distributed.checkpoint"' in out


def test_private_list_comes_from_installed_torch():
    names = torch_suite.private_submodules()
    assert {"_traverse", "_fsspec_filesystem", "_dedup_save_plans", "_hf_utils"} <= names
    assert not any(not n.startswith("_") for n in names)
    out, n = torch_suite.swap_source("from torch.distributed.checkpoint._dedup_save_plans import x\n")
    assert n == 0 and "torch.distributed.checkpoint._dedup_save_plans" in out


def test_first_error_picks_the_exception_line():
    text = ("E   RuntimeError: Process 0 exited with error code 10 and exception:\n"
            "Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n"
            "AttributeError: 'bytes' object has no attribute 'state_dict_metadata'\n")
    assert torch_suite.first_error(text) == "AttributeError: 'bytes' object has no attribute 'state_dict_metadata'"
    assert torch_suite.first_error("E   AssertionError: 1 != 2\n") == "AssertionError: 1 != 2"


def test_measure_counts_only_stock_passes_and_import_failures(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    # passes on stock, fails on ours (names the module), passes on both, skipped on both
    (suite / "test_mixed.py").write_text(textwrap.dedent('''
        import pytest
        import torch.distributed.checkpoint as dcp

        def test_is_torch():
            assert dcp.__name__.startswith("torch.")

        def test_has_save():
            assert callable(dcp.save)

        def test_skipped():
            pytest.skip("needs CUDA")

        def test_fails_on_stock():
            assert False
    '''))
    # fails at import on ours only: every stock pass in it counts as failed
    (suite / "test_import_error.py").write_text(textwrap.dedent('''
        import torch.distributed.checkpoint as dcp
        if not dcp.__name__.startswith("torch."):
            raise ImportError("swapped module refused")

        def test_one():
            pass

        def test_two():
            pass
    '''))
    files = torch_suite.discover(suite)
    assert files == ["test_import_error.py", "test_mixed.py"]
    results = {r.file: r for r in torch_suite.measure(suite, files, tmp_path / "work", sys.executable, 240,
                                                       log=lambda *_: None)}

    mixed = results["test_mixed.py"]
    assert (mixed.collected, mixed.stock_pass, mixed.ours_pass) == (4, 2, 1)
    [(failed, why)] = mixed.failures.items()
    assert failed.endswith("test_is_torch") and why.startswith("failed: AssertionError")

    imp = results["test_import_error.py"]
    assert (imp.stock_pass, imp.ours_pass) == (2, 0)
    assert all(v.startswith("import error: ImportError: swapped module refused") for v in imp.failures.values())
    assert "| **total** | | 6 | 4 | 1 | 3 | 25.0% |" in torch_suite.table(list(results.values()))
