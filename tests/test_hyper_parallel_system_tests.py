"""scripts/hyper_parallel_system_tests.py: the NPU rewrite, the harness shim, launcher parsing, a real run.

The runner itself is opt-in (HyperParallel's suite takes long on CPU ranks and is not ours to
ship); these tests hold its pieces on synthetic sources, and run it once end to end on a two-case
folder over two gloo ranks.
"""

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("hp_system_tests", ROOT / "scripts" / "hyper_parallel_system_tests.py")
runner = importlib.util.module_from_spec(spec)
sys.modules["hp_system_tests"] = runner  # dataclasses look their module up while the class is built
spec.loader.exec_module(runner)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_rewrite_changes_only_npu_ties():
    src = textwrap.dedent('''\
        import os
        import torch_npu  # pylint: disable=W0611
        from torch_npu.contrib import transfer_to_npu
        try:
            import torch_npu
        except ImportError:
            pass
        x = torch.ones(2).npu()
        mesh = init_device_mesh(device_type="npu", mesh_shape=(2,))
        mesh2 = DeviceMesh(device_type = 'npu', mesh=[0, 1])
        dev = torch.device("npu", device_id)
        dist.init_process_group(backend="hccl")
        load(sd, checkpoint_id=path, device_type=dt)   # not a literal: unchanged
        y = x.npu(0)                                   # an argument: not the rule's form
        note = "runs on npu"
        ''')
    out, edits = runner.rewrite_npu(src)
    compile(out, "<rewritten>", "exec")  # the import inside try stays a valid block
    statements = [line.split("#")[0].strip() for line in out.splitlines()]
    assert not [s for s in statements if "torch_npu" in s]
    assert out.count("pass  # torch_npu import dropped") == 3
    assert "torch.ones(2).cpu()" in out
    assert 'device_type="cpu", mesh_shape=(2,)' in out
    assert "device_type = 'cpu'" in out
    assert 'torch.device("cpu", device_id)' in out
    assert 'backend="gloo"' in out
    assert "device_type=dt" in out and "x.npu(0)" in out and '"runs on npu"' in out
    assert edits == 8
    assert out.splitlines()[0] == "import os"


def test_rewrite_leaves_a_file_without_npu_untouched():
    src = "from hyper_parallel.core.distributed_checkpoint import load\nload({}, checkpoint_id='x')\n"
    assert runner.rewrite_npu(src) == (src, 0)


def test_launchers_give_each_case_its_rank_count(tmp_path):
    cases = tmp_path / "distributed_checkpoint"
    _write(cases / "dcp_alpha.py", '''\
        def test_two(): pass
        def test_four(): pass
        def test_off(): pass
        def test_unnamed(): pass
        def helper(): pass
        ''')
    _write(cases / "dcp_beta.py", "def test_lonely(): pass\n")
    _write(cases / "_impl.py", "def test_suite(): pass\n")
    _write(cases / "test_dcp_alpha.py", '''\
        from tests.common.parallel_case import parallel_run, TorchCase
        ALPHA = "dcp_alpha.py"
        _WORLD = 4

        def test_npu_variant():
            parallel_run([TorchCase(ALPHA, "test_four", 12345, 8)])

        def test_alpha_gloo():
            parallel_run([
                TorchCase(ALPHA, "test_two", num_proc=2),
                TorchCase(ALPHA, "test_four", num_proc=_WORLD),
                #TorchCase(ALPHA, "test_off", 12346, 4),
            ])
        ''')
    _write(cases / "test_gone.py", '''\
        def test_gone():
            parallel_run([TorchCase("tests/torch/other/gone.py", "test_x", 1, 1)])
        ''')
    _write(cases / "test_impl.py", '''\
        import importlib
        def test_suite_entry():
            return importlib.import_module("tests.torch.distributed_checkpoint._impl").test_suite()
        ''')
    found = {c.id: c for c in runner.discover(cases, default_ranks=3)}
    assert found["dcp_alpha.py::test_two"].ranks == 2
    assert found["dcp_alpha.py::test_four"].ranks == 4  # the *_gloo launcher wins over the NPU one
    off = found["dcp_alpha.py::test_off"]
    assert (off.ranks, off.disabled_upstream) == (4, True)
    # named by no launcher: the counts its file's live cases use disagree (2, 4, 8), so the default
    assert (found["dcp_alpha.py::test_unnamed"].ranks, found["dcp_alpha.py::test_unnamed"].ranks_from) == (3, "default")
    assert found["dcp_beta.py::test_lonely"].ranks_from == "default"
    assert found["test_impl.py::test_suite_entry"].ranks_from == "direct"
    assert "_impl.py::test_suite" not in found  # reached through test_impl.py only
    assert found["gone.py::test_x"].missing
    assert "dcp_alpha.py::helper" not in found


def test_a_case_no_launcher_names_takes_its_files_agreed_count(tmp_path):
    cases = tmp_path / "c"
    _write(cases / "dcp_x.py", "def test_a(): pass\ndef test_b(): pass\n")
    _write(cases / "test_dcp_x.py", 'def test_l():\n    parallel_run([TorchCase("dcp_x.py", "test_a", num_proc=2)])\n')
    found = {c.id: c for c in runner.discover(cases)}
    assert (found["dcp_x.py::test_b"].ranks, found["dcp_x.py::test_b"].ranks_from) == (2, "inferred")


def test_build_tree_writes_the_shim_and_keeps_a_checkouts_common_net(tmp_path):
    checkout = tmp_path / "hp"
    _write(checkout / "tests/torch/distributed_checkpoint/dcp_x.py", "import torch_npu\nx = t.npu()\n")
    _write(checkout / "tests/torch/common_net.py", "W = torch.ones(2).npu()\n")
    dest = tmp_path / "tree"
    info = runner.build_tree(checkout, dest)
    assert (dest / "tests/torch/distributed_checkpoint/dcp_x.py").read_text().endswith("x = t.cpu()\n")
    assert (dest / "tests/torch/common_net.py").read_text() == "W = torch.ones(2).cpu()\n"
    assert info["npu_edits"] == {"dcp_x.py": 2, "../common_net.py": 1}
    for pkg in ("tests", "tests/torch", "tests/torch/distributed_checkpoint"):
        assert (dest / pkg / "__init__.py").is_file()
    utils = (dest / "tests/torch/utils.py").read_text()
    compile(utils, "utils.py", "exec")
    assert '_DEVICE_TYPE = "cpu"' in utils and 'backend="gloo"' in utils

    shim_dest = tmp_path / "tree2"
    assert runner.build_tree(checkout / "tests/torch/distributed_checkpoint", shim_dest, "shim")["common_net"] == "shim"
    namespace: dict = {}
    exec(compile((shim_dest / "tests/torch/common_net.py").read_text(), "common_net.py", "exec"), namespace)
    import torch

    net = namespace["FullyShardTestNet"](4, 2, has_bias=False, dense_weight_init=torch.rand)
    assert list(net.state_dict()) == ["w1", "dense_layers.layers.layer0.weight", "dense_layers.layers.layer1.weight"]


def test_build_tree_refuses_a_folder_without_cases(tmp_path):
    with pytest.raises(SystemExit, match="no tests/torch/distributed_checkpoint"):
        runner.build_tree(tmp_path, tmp_path / "out")


def test_first_error_skips_peer_noise_and_names_our_frame():
    output = textwrap.dedent('''\
        E   RuntimeError: [../third_party/gloo/transport/tcp/pair.cc:534] Connection closed by peer
          File "/x/hyper_parallel/core/distributed_checkpoint/_src/engine/checkpoint.py", line 12, in load
        hyper_parallel/core/distributed_checkpoint/_src/planning/standard.py:88: in plan
        E   ValueError: shard of 'w' does not fit
        E   assert False
        ''')
    error, where = runner.first_error(output)
    assert error == "ValueError: shard of 'w' does not fit"
    assert where == "hyper_parallel/core/distributed_checkpoint/_src/planning/standard.py:88"


def test_first_error_of_a_bare_assert_carries_its_where_line():
    output = "E       assert False\nE        +  where False = isinstance(3, str)\n"
    assert runner.first_error(output) == ("assert False (where False = isinstance(3, str))", "")


def test_runs_cases_on_their_ranks_and_reports_each(tmp_path):
    """End to end over two gloo ranks: an NPU-tied case that passes once rewritten, and one that fails."""
    cases = tmp_path / "hp" / "tests/torch/distributed_checkpoint"
    _write(cases / "dcp_demo.py", '''\
        import torch
        import torch.distributed as dist
        import torch_npu  # pylint: disable=W0611
        from tests.torch.utils import init_dist

        def test_sum_over_ranks():
            rank, device_id = init_dist()
            assert device_id == 0 and dist.get_world_size() == 2
            value = torch.tensor([rank + 1.0]).npu()
            dist.all_reduce(value)
            assert value.item() == 3.0

        def test_rank_one_disagrees():
            rank, _ = init_dist()
            assert rank == 0, f"rank {rank} was told to fail"
        ''')
    _write(cases / "test_dcp_demo.py", '''\
        DEMO = "dcp_demo.py"
        def test_demo_gloo():
            parallel_run([TorchCase(DEMO, "test_sum_over_ranks", num_proc=2),
                          TorchCase(DEMO, "test_rank_one_disagrees", num_proc=2)])
        ''')
    report = tmp_path / "results.json"
    rc = runner.main([str(tmp_path / "hp"), "--json", str(report), "--timeout", "240"])
    results = {r["case"]: r for r in json.loads(report.read_text())["results"]}
    assert rc == 1
    passed = results["dcp_demo.py::test_sum_over_ranks"]
    assert (passed["result"], passed["ranks"]) == ("pass", 2)
    failed = results["dcp_demo.py::test_rank_one_disagrees"]
    assert failed["result"] == "fail"
    assert "rank 1 was told to fail" in failed["first_error"]
