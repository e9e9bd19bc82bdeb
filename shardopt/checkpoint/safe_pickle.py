"""Read PyTorch DCP checkpoints without running code from them.

A DCP directory's ``.metadata`` is a pickle, and DCP stores every non-tensor value (param-group
hyperparameters, Python scalars) as a ``torch.save`` blob; torch reads the first with full ``pickle`` and the
second with ``torch.load(weights_only=False)``, so a crafted file runs arbitrary code the moment it is read.
Here ``.metadata`` goes through an unpickler that can build only DCP's metadata classes and the few plain
values they hold (``torch.Size``, dtypes, layouts, paths), the blobs go through ``torch.load(weights_only=True)``,
and anything else is a ``CheckpointError`` naming the file and the refused global. Tensor data was already
read with ``weights_only=True`` by DCP itself.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, BinaryIO, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .logical import CheckpointError

__all__ = [
    "RestrictedUnpickler",
    "load_dcp_metadata",
    "load_plain",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "read_dcp_state_dict",
]

_METADATA_CLASSES = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a lookup in torch's table of layouts, by name
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only DCP's metadata classes (and torch dtypes); any other global, and any
    persistent id, raises ``pickle.UnpicklingError`` before anything is called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not a DCP metadata class")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"persistent id {pid!r} is not allowed in DCP metadata")


def load_dcp_metadata(source: str | BinaryIO) -> Metadata:
    """The ``Metadata`` of a DCP ``.metadata`` file (a path or an open binary file), read without running
    anything in it. A crafted, corrupt or non-DCP file raises ``CheckpointError``."""
    where = source if isinstance(source, str) else getattr(source, "name", "<stream>")
    try:
        if isinstance(source, str):
            with open(source, "rb") as f:
                meta = RestrictedUnpickler(f).load()
        else:
            meta = RestrictedUnpickler(source).load()
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{where}: refusing to read DCP metadata: {err}; the file is not a DCP checkpoint "
            "written by torch.distributed.checkpoint (nothing in it was run)"
        ) from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError) as err:
        raise CheckpointError(f"{where}: unreadable DCP metadata ({type(err).__name__}: {err})") from None
    if not isinstance(meta, Metadata):
        raise CheckpointError(f"{where}: DCP metadata holds a {type(meta).__name__}, not a Metadata")
    return meta


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_plain(path: str, map_location: Any = None) -> Any:
    """``torch.load(path, weights_only=True)``: tensors, containers and scalars only. A file that needs any
    other global (a crafted pickle) raises ``CheckpointError`` before anything in it runs."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path}: refusing to unpickle, the file holds more than tensors and plain data "
            f"({_first_line(err)}); nothing in it was run"
        ) from None


def _load_blob(value: io.BytesIO, fqn: str) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"refusing to unpickle DCP value {fqn!r}: it is not plain data ({_first_line(err)}); nothing in it was run"
        ) from None


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata comes from ``load_dcp_metadata`` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_dcp_metadata(cast(BinaryIO, f))  # opened "rb": a binary stream
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class _WeightsOnlyBytes:
    """Planner mixin: non-tensor values are read with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = _load_blob(value, read_item.dest_index.fqn)
        if self.flatten_state_dict:  # type: ignore[attr-defined]
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)  # type: ignore[attr-defined]
        else:
            self.state_dict[read_item.dest_index.fqn] = obj  # type: ignore[attr-defined]


def _old_state_key_names() -> dict[str, list[str]]:
    """Today's optimizer state key -> the older names it had (every class's ``state_key_renames``)."""
    from ..optim.registry import OPTIMIZERS

    olds: dict[str, list[str]] = {}
    for cls in OPTIMIZERS.values():
        for old, new in getattr(cls, "state_key_renames", {}).items():
            if old not in olds.setdefault(new, []):
                olds[new].append(old)
    return olds


class SafeLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    """``DefaultLoadPlanner`` (load into an existing state dict) that never unpickles code, and reads an
    optimizer state entry that the checkpoint holds under an older key name (``state_key_renames``: a DCP
    checkpoint written before issue 18's renames) into today's entry. A param group's ``param_names`` that the
    checkpoint lacks (written before optimizers built from a model carried them) keeps today's names."""

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        saved = metadata.state_dict_metadata if metadata is not None else {}
        if not self.flatten_state_dict or not saved:
            return
        olds = _old_state_key_names()
        for fqn in [k for k in self.state_dict if k not in saved]:
            head, _, key = fqn.rpartition(".")
            if key == "param_names" and ".param_groups." in f".{head}":
                del self.state_dict[fqn], self.mappings[fqn]  # the template's names stay in place
                continue
            for old in olds.get(key, ()):
                if head and f"{head}.{old}" in saved:
                    # the same tensor object, read under the saved name: it fills today's entry in place
                    self.state_dict[f"{head}.{old}"] = self.state_dict.pop(fqn)
                    self.mappings[f"{head}.{old}"] = self.mappings.pop(fqn)
                    break


class _SafeEmptyStateDictPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    """Rebuilds the whole saved state dict from the metadata (as ``dcp_to_torch_save`` does), safely."""


def _checkpoint_error_in(err: BaseException) -> CheckpointError | None:
    """Our own error, if DCP wrapped one in its ``CheckpointException``."""
    if isinstance(err, CheckpointError):
        return err
    for pair in (getattr(err, "failures", None) or {}).values():
        exc = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(exc, CheckpointError):
            return exc
    return None


def read_dcp_state_dict(path: str) -> dict[str, Any]:
    """The full nested state dict of the DCP directory ``path`` in this process (no process group needed),
    read without unpickling code. Raises ``CheckpointError`` for crafted, incomplete or corrupt checkpoints."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, Any] = {}
    try:
        _load_state_dict(
            sd, storage_reader=SafeFileSystemReader(path), planner=_SafeEmptyStateDictPlanner(), no_dist=True
        )
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # DCP's CheckpointException derives from BaseException
        ours = _checkpoint_error_in(err)
        if ours is not None:
            raise CheckpointError(f"{path}: {ours}") from None
        last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: incomplete or corrupt DCP checkpoint ({last})") from None
    return sd
