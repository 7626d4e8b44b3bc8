"""The allow-list unpickler of DCP's ``.metadata`` (``training.checkpointing.read_dcp_metadata``) on the pickle
forms every supported Python writes, whichever interpreter runs the test.

DCP pickles ``Metadata`` with the interpreter's default protocol (4; 5 from Python 3.14).  What differs between
Pythons, and is therefore crafted here explicitly rather than left to the running interpreter:

* the enum ``_MEM_FORMAT_ENCODING`` inside ``TensorProperties``: ``EnumClass(value)`` on 3.10, later 3.11 and
  3.12+, ``getattr(EnumClass, "NAME")`` on early 3.11 releases (Debian 12's 3.11.2);
* the checkpoint path in ``StorageMeta``: ``pathlib.PosixPath`` up to 3.12, ``pathlib._local.PosixPath`` from
  3.13 on.
"""

import enum
import io
import pickle
import signal
import warnings
from pathlib import Path, PurePosixPath

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from deepseek_v41.training.checkpointing import _enum_member, read_dcp_metadata

DCP_METADATA = "torch.distributed.checkpoint.metadata"


def metadata(dtype=torch.bfloat16, checkpoint_id=Path("/runs/a/checkpoints/step_00000002.tmp")) -> Metadata:
    """A two-item ``Metadata`` as DCP's planner writes it; channels_last so that the enum member is not 0."""
    props = TensorProperties(dtype=dtype, memory_format=torch.channels_last)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3]))
    return Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(props, torch.Size([4, 3]), [chunk]),
                             "step": BytesStorageMetadata()},
        storage_data={MetadataIndex("w", torch.Size([0, 0]), 0): _StorageInfo("__0_0.distcp", 0, 1200),
                      MetadataIndex("step"): _StorageInfo("__0_0.distcp", 1200, 80)},
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id="e3b0c442"),
        version="1.0.0",
    )


class EnumByName(pickle.Pickler):
    """Pickles enum members the way early Python 3.11 does (``Enum.__reduce_ex__``): getattr(cls, name)."""

    def reducer_override(self, obj):
        return (getattr, (type(obj), obj.name)) if isinstance(obj, enum.Enum) else NotImplemented


class EnumByValue(pickle.Pickler):
    """Pickles enum members the way 3.10, later 3.11 and 3.12+ do: cls(value)."""

    def reducer_override(self, obj):
        return (type(obj), (obj.value,)) if isinstance(obj, enum.Enum) else NotImplemented


def dumps(obj, pickler=pickle.Pickler, protocol=pickle.DEFAULT_PROTOCOL) -> bytes:
    buf = io.BytesIO()
    pickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


def read(tmp_path, data: bytes):
    (tmp_path / ".metadata").write_bytes(data)
    return read_dcp_metadata(tmp_path)


# Protocol 4 opcodes (DCP's form), written by hand for what this interpreter would not write itself.
def text(s: str) -> bytes:
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


def glob(module: str, name: str) -> bytes:
    return text(module) + text(name) + b"\x93"  # STACK_GLOBAL


def call(func: bytes, *args: bytes) -> bytes:
    assert 1 <= len(args) <= 3
    return func + b"".join(args) + b"\x85\x86\x87"[len(args) - 1:len(args)] + b"R"  # TUPLEn, REDUCE


def stream(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."  # PROTO 4 ... STOP


# ---- the forms DCP writes -----------------------------------------------------------------------------------


def test_what_dcp_writes_on_this_interpreter_reads_back(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP saves as a single rank and says so
        dcp.save({"w": torch.arange(12, dtype=torch.bfloat16).view(4, 3), "n": 3},
                 storage_writer=dcp.FileSystemWriter(tmp_path))
    data = (tmp_path / ".metadata").read_bytes()
    assert read_dcp_metadata(tmp_path) == pickle.loads(data)


@pytest.mark.parametrize("protocol", [4, 5])  # DCP: the default protocol, 4 (5 from Python 3.14)
@pytest.mark.parametrize("pickler, marker", [(EnumByName, True), (EnumByValue, False)], ids=["by_name", "by_value"])
def test_enum_members_by_name_and_by_value(tmp_path, pickler, marker, protocol):
    data = dumps(metadata(), pickler, protocol)
    assert (b"getattr" in data) is marker  # the stream really has the form this case is about
    loaded = read(tmp_path, data)
    assert loaded == metadata()
    props = loaded.state_dict_metadata["w"].properties
    assert props.memory_format is torch.channels_last and props.layout is torch.strided


def test_debian_3_11_2_enum_form_crafted_by_hand(tmp_path):
    enum_cls = glob(DCP_METADATA, "_MEM_FORMAT_ENCODING")
    by_name = call(glob("builtins", "getattr"), enum_cls, text("TORCH_CHANNELS_LAST"))
    by_value = call(enum_cls, b"K\x01")  # BININT1 1
    for body in (by_name, by_value):
        assert read(tmp_path, stream(body)) is _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int16, torch.int64,
                                   torch.bool])
def test_dtypes(tmp_path, dtype):
    assert read(tmp_path, dumps(metadata(dtype))).state_dict_metadata["w"].properties.dtype is dtype


@pytest.mark.parametrize("module", ["pathlib", "pathlib._local"])
@pytest.mark.parametrize("name, cls", [("PosixPath", Path), ("PurePosixPath", PurePosixPath)])
def test_paths_from_either_pathlib_module(tmp_path, module, name, cls):
    """3.13 pickles paths from ``pathlib._local``: a checkpoint saved there resumes on 3.12 and back."""
    loaded = read(tmp_path, stream(call(glob(module, name), text("/runs"), text("step_00000002"))))
    assert type(loaded) is type(cls("/runs")) and loaded == cls("/runs/step_00000002")


# ---- everything else is refused ---------------------------------------------------------------------------

ENUM = glob(DCP_METADATA, "_MEM_FORMAT_ENCODING")
GETATTR = glob("builtins", "getattr")


@pytest.mark.parametrize("body, message", [
    (call(glob("builtins", "eval"), text("1+1")), "builtins.eval is not part"),
    (call(glob("os", "system"), text("true")), "os.system is not part"),
    # a dotted name walks the module's own imports under protocol 4
    (call(glob(DCP_METADATA, "os.system"), text("true")), "metadata.os.system is not part"),
    (glob(DCP_METADATA, "torch.load"), "metadata.torch.load is not part"),
    (glob(DCP_METADATA, "os"), "metadata.os is not part"),
    (glob(DCP_METADATA, "field"), "metadata.field is not part"),  # dataclasses.field, imported there
    (glob(DCP_METADATA, "Enum"), "metadata.Enum is not part"),  # enum.Enum, imported there
    (glob(DCP_METADATA, "__builtins__"), "metadata.__builtins__ is not part"),
    (glob("torch.distributed.checkpoint.filesystem", "FileSystemReader"), "FileSystemReader is not part"),
    (glob("torch", "load"), "torch.load is not part"),
    (glob("pathlib", "Path.home"), "pathlib.Path.home is not part"),
    (glob("pathlib._local", "os"), "pathlib._local.os is not part"),
    (glob("collections", "OrderedDict.fromkeys"), "OrderedDict.fromkeys is not part"),
    (glob("subprocess", "Popen"), "subprocess.Popen is not part"),
    # getattr: only an allowed enum class and one of its member names
    (call(GETATTR, glob(DCP_METADATA, "os"), text("system")), "metadata.os is not part"),
    (call(GETATTR, ENUM, text("__class__")), "getattr.*'__class__'.* is not part"),
    (call(GETATTR, ENUM, text("_missing_")), "getattr.*'_missing_'.* is not part"),
    (call(GETATTR, ENUM, text("mro")), "getattr.*'mro'.* is not part"),
    (call(GETATTR, ENUM, text("NO_SUCH_MEMBER")), "getattr.*'NO_SUCH_MEMBER'.* is not part"),
    (call(GETATTR, glob(DCP_METADATA, "TensorProperties"), text("__init__")), "getattr.*'__init__'.* is not part"),
    (call(GETATTR, glob("torch", "Size"), text("__class__")), "getattr.*Size.* is not part"),
    (call(GETATTR, glob("torch", "bfloat16"), text("to")), "getattr.*bfloat16.* is not part"),
], ids=lambda v: v if isinstance(v, str) else "stream")
def test_everything_else_is_refused(tmp_path, body, message):
    with pytest.raises(pickle.UnpicklingError, match=message):
        read(tmp_path, stream(body))


def test_getattr_stand_in_refuses_an_enum_outside_dcp():
    with pytest.raises(pickle.UnpicklingError, match="Signals.*'SIGKILL'.* is not part"):
        _enum_member(signal.Signals, "SIGKILL")
    assert _enum_member(_MEM_FORMAT_ENCODING, "TORCH_PRESERVE_FORMAT") is _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT
