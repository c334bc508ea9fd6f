"""torch 2.13's parameters, our constructors and functions: every one of torch's names is taken
(public ones in torch's positional order), and torch's private options we do not support
(``_extensions``, ``_extension_registry``) are refused naming the option and saying why,
never a generic ``TypeError`` nor silently dropped. One process, real files."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

import hyper_parallel.core.distributed_checkpoint as ours
from hyper_parallel.core.distributed_checkpoint import FileSystemReader, FileSystemWriter, FsspecWriter, load, save
from hyper_parallel.core.distributed_checkpoint._src.base.errors import CheckpointError, UnsupportedValueError

NAMES = ["save", "load", "async_save", "FileSystemWriter", "FileSystemReader", "HuggingFaceStorageWriter",
         "HuggingFaceStorageReader", "QuantizedHuggingFaceStorageReader"]


class _Reverse(StreamTransformExtension):
    """A stream transform (torch's ZStandard needs zstandard installed; any extension will do)."""

    @staticmethod
    def registry_name() -> str:
        return "test_reverse"

    @staticmethod
    def from_descriptor(version: str) -> _Reverse:
        return _Reverse()

    def get_descriptor(self) -> str:
        return "test_reverse/1"

    def transform_to(self, output):
        return output

    def transform_from(self, input):
        return input


def _params(obj: object) -> list[inspect.Parameter]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sig = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
    return [p for p in sig.parameters.values() if p.name != "self"
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


@pytest.mark.parametrize("name", NAMES)
def test_every_torch_parameter_name_is_taken(name):
    theirs, mine = _params(getattr(tdcp, name)), {p.name for p in _params(getattr(ours, name))}
    assert [p.name for p in theirs if p.name not in mine] == []


@pytest.mark.parametrize("name", NAMES)
def test_torch_positional_parameters_keep_their_positions(name):
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    theirs = [p.name for p in _params(getattr(tdcp, name)) if p.kind in positional]
    mine = [p.name for p in _params(getattr(ours, name)) if p.kind in positional]
    public = theirs[:next((i for i, n in enumerate(theirs) if n.startswith("_")), len(theirs))]
    if inspect.isfunction(getattr(tdcp, name)):  # save(sd, path): the path second (keyword-only in torch)
        mine = [n for n in mine if n != "path"]
    assert mine[:len(public)] == public


def test_file_system_writer_refuses_stream_transforms_naming_the_option(tmp_path):
    with pytest.raises(UnsupportedValueError) as info:
        FileSystemWriter(str(tmp_path), _extensions=[_Reverse()])
    msg = str(info.value)
    assert msg.startswith("FileSystemWriter(_extensions=[") and "stream transforms" in msg
    assert "Pass no _extensions" in msg
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, TypeError)


@pytest.mark.parametrize("empty", [None, [], ()])
def test_file_system_writer_with_no_extensions_saves(tmp_path, empty):
    save({"w": torch.arange(4.0)}, storage_writer=FileSystemWriter(str(tmp_path), _extensions=empty), no_dist=True)
    assert torch.equal(load(path=str(tmp_path))["w"], torch.arange(4.0))


def test_file_system_reader_refuses_an_extension_registry_naming_the_option(tmp_path):
    save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(UnsupportedValueError, match=r"^FileSystemReader\(_extension_registry=.*Pass no "
                                                   r"_extension_registry"):
        FileSystemReader(str(tmp_path), _extension_registry=ExtensionRegistry())
    out = {"w": torch.zeros(2)}  # None asks for nothing
    load(out, storage_reader=FileSystemReader(str(tmp_path), _extension_registry=None), no_dist=True)
    assert torch.equal(out["w"], torch.ones(2))


def test_fsspec_writer_refuses_stream_transforms_instead_of_passing_them_to_fsspec():
    with pytest.raises(UnsupportedValueError, match=r"^FsspecWriter\(_extensions=\[.*stream transforms"):
        FsspecWriter("memory://private-options/a", _extensions=[_Reverse()])
    writer = FsspecWriter("memory://private-options/b", _extensions=None)
    assert "_extensions" not in writer._options  # never handed to the filesystem as a storage option


def test_fsspec_writer_takes_torchs_arguments_in_torchs_order(tmp_path):
    url = f"file://{tmp_path / 'ck'}"
    writer = FsspecWriter(url, True, True, 3, 10, False)  # torch's positional order: ..., thread_count, ..., overwrite
    assert writer.thread_count == 3 and writer.overwrite is False
    save({"w": torch.ones(2)}, storage_writer=writer, no_dist=True)
    with pytest.raises(CheckpointError):  # overwrite=False honoured: a committed checkpoint is not replaced
        save({"w": torch.zeros(2)}, storage_writer=FsspecWriter(url, overwrite=False), no_dist=True)
    reader = FileSystemReader(str(tmp_path / "ck"), None)  # torch's positional _extension_registry=None
    assert reader.read_metadata().state_dict_metadata["w"].size == torch.Size([2])
