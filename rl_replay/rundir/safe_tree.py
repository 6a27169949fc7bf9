"""Nested Python data with tensors, stored in a form whose reading executes no code.

A checkpoint is a tree: dicts (of any plain keys), lists, tuples, strings, numbers, bools,
None, ``bytes``, torch tensors, numpy arrays and numpy scalars. :func:`dumps` writes it as one
`safetensors <https://huggingface.co/docs/safetensors>`_ file: every tensor (and every numpy
array, and every ``bytes`` value as a uint8 tensor) becomes a named tensor, and the tree's
shape, with each of those leaves replaced by ``{"$t": name}`` (plus its kind), becomes JSON in
the file's metadata. :func:`loads` reads it back with ``safetensors`` and ``json`` only: no
pickle, so a file from someone else can hold wrong numbers but cannot run anything.

The round trip is exact: tensors keep dtype and values, numpy arrays and scalars keep their
dtype, tuples stay tuples, integer dict keys stay integers (an optimizer's state is keyed by
parameter index). ``bytes`` come back as ``bytes``: what they hold is for the caller to decide
whether to trust (the environment pickles of :mod:`rl_replay.rundir.env_state_file` are MAC-checked first).

Reading is bounded as well as code-free: the tree's JSON may nest at most :data:`MAX_DEPTH`
levels (checked before it is parsed), and a numpy dtype named in it must be a plain number or
bool (no structured or sub-array dtype, which could declare an array far larger than its data).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np
import torch

__all__ = ["dumps", "loads", "TREE_KEY"]

TREE_KEY = "rl_replay.tree"

# numpy dtypes torch has no tensor dtype for are stored widened (and narrowed back on load).
_WIDEN = (np.dtype(np.uint16), np.dtype(np.uint32))

#: How deeply a stored tree may nest (a trainer's checkpoint nests 6 levels).
MAX_DEPTH = 64
#: How many JSON values a stored tree may hold: parsing each costs memory far beyond its bytes
#: (``{}`` is 2 bytes of text and a 64-byte dict). A trainer's tree holds a few thousand per rank.
MAX_VALUES = 1_000_000
# The dtypes a stored numpy array may name: plain bools, integers, floats and complex numbers
# of either byte order, as ``dtype.str`` writes them ('<f4', '|b1', '>i8').
_DTYPE = re.compile(r"[<>|=]?[biufc]\d{1,2}")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _dtype(text: Any) -> np.dtype:
    if not (isinstance(text, str) and _DTYPE.fullmatch(text)):
        raise ValueError(f"dtype {text!r:.40} is not a plain numeric or bool dtype")
    dtype = np.dtype(text)
    if dtype.kind not in "biufc" or dtype.shape or dtype.fields is not None:
        raise ValueError(f"dtype {text!r} is not a plain numeric or bool dtype")
    return dtype


def _shape_of(text: bytes) -> tuple[int, int]:
    """``(depth, values)`` of the JSON ``text``, counted without parsing it (strings removed
    first): how deeply it nests, and about how many values parsing it would make (each bracket
    opens one, each comma separates two)."""
    chars = np.frombuffer(_STRING.sub(b'""', text), dtype=np.uint8)
    opens = (chars == ord("[")) | (chars == ord("{"))
    steps = opens.astype(np.int8) - ((chars == ord("]")) | (chars == ord("}"))).astype(np.int8)
    depth = int(np.cumsum(steps, dtype=np.int32).max(initial=0))
    return depth, int(opens.sum()) + int((chars == ord(",")).sum()) + 1


class _Writer:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[tuple[str, int]] = set()

    def _add(self, tensor: torch.Tensor) -> str:
        name = str(len(self.tensors))
        tensor = tensor.detach().to("cpu")
        if tensor.layout != torch.strided:
            raise TypeError(f"cannot store a {tensor.layout} tensor; convert it to a dense tensor first")
        # safetensors refuses tensors that share memory (tied weights, views of one buffer).
        storage = (str(tensor.device), tensor.untyped_storage().data_ptr())
        if storage in self._storages or not tensor.is_contiguous() or tensor.storage_offset():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        elif tensor.numel():
            self._storages.add(storage)
        self.tensors[name] = tensor
        return name

    def encode(self, obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int) and not isinstance(obj, bool):
            return obj
        if isinstance(obj, float):
            # JSON has no inf / nan: keep them as text, the rest as numbers.
            return obj if math.isfinite(obj) else {"$f": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return {"$t": self._add(obj)}
        if isinstance(obj, np.ndarray) or isinstance(obj, np.generic):
            array = np.asarray(obj)
            if array.dtype == object:
                raise TypeError("cannot store a numpy array of Python objects")
            # (np.ascontiguousarray would turn a 0-d array into a 1-d one.)
            native = np.int64 if array.dtype in _WIDEN else array.dtype.newbyteorder("=")
            stored = torch.from_numpy(np.array(array, dtype=native, order="C"))
            return {"$np": self._add(stored), "dtype": array.dtype.str, "scalar": isinstance(obj, np.generic)}
        if isinstance(obj, (bytes, bytearray)):
            return {
                "$b": self._add(
                    torch.frombuffer(bytearray(obj), dtype=torch.uint8) if obj else torch.zeros(0, dtype=torch.uint8)
                )
            }
        if isinstance(obj, tuple):
            return {"$tuple": [self.encode(v) for v in obj]}
        if isinstance(obj, list):
            return [self.encode(v) for v in obj]
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in obj):
                return {k: self.encode(v) for k, v in obj.items()}
            return {"$dict": [[self.encode(k), self.encode(v)] for k, v in obj.items()]}
        raise TypeError(f"cannot store a value of type {type(obj).__module__}.{type(obj).__qualname__}")


def dumps(tree: Any, metadata: dict[str, str] | None = None) -> bytes:
    """``tree`` as the bytes of a safetensors file (``metadata``: extra string fields)."""
    from safetensors.torch import save

    writer = _Writer()
    encoded = writer.encode(tree)
    meta = dict(metadata or {})
    meta[TREE_KEY] = json.dumps(encoded, separators=(",", ":"))
    # The limits of loads apply at write too: a tree written is a tree that reads back.
    depth, values = _shape_of(meta[TREE_KEY].encode())
    if depth > MAX_DEPTH or values > MAX_VALUES:
        raise ValueError(
            f"cannot store a tree nesting {depth} levels with about {values:,} values: it would not read back "
            f"(at most {MAX_DEPTH} levels and {MAX_VALUES:,} values)"
        )
    return save(writer.tensors, metadata=meta)


class _Reader:
    """Decodes a tree's JSON against its tensors, each tensor taken once, the copies counted.

    :func:`dumps` names every leaf's tensor once, so a tree naming one tensor twice was not
    written by it; taken at its word, one small tensor named thousands of times as ``bytes``
    (each a copy) or as a wider numpy dtype (complex128 is 16 bytes per uint8) decodes to far
    more than the file holds. ``budget`` bounds the bytes decoding copies.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], budget: int | None) -> None:
        self.tensors, self.budget, self.copied = tensors, budget, 0
        self._taken: set[str] = set()

    def _take(self, name: Any) -> torch.Tensor:
        if not isinstance(name, str) or name not in self.tensors:
            raise KeyError(f"no tensor {name!r:.40}")
        if name in self._taken:
            raise ValueError(f"tensor {name!r:.40} is referenced more than once (a stored tree names each once)")
        self._taken.add(name)
        return self.tensors[name]

    def _copy(self, nbytes: int) -> None:
        self.copied += nbytes
        if self.budget is not None and self.copied > self.budget:
            raise MemoryBudgetError(
                f"it decodes to over {self.copied} bytes of copies, more than this process can hold "
                f"({self.budget} bytes free)"
            )

    def decode(self, node: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"it nests deeper than {MAX_DEPTH} levels")
        depth += 1
        if isinstance(node, list):
            return [self.decode(v, depth) for v in node]
        if not isinstance(node, dict):
            return node
        if "$t" in node:
            return self._take(node["$t"])
        if "$np" in node:
            stored, dtype = self._take(node["$np"]).numpy(), _dtype(node["dtype"])
            if dtype != stored.dtype:
                self._copy(stored.size * dtype.itemsize)
            array = stored.astype(dtype, copy=False)
            return array[()] if node["scalar"] else array
        if "$b" in node:
            stored = self._take(node["$b"]).numpy()
            self._copy(stored.nbytes)
            return stored.tobytes()
        if "$f" in node:
            return float(node["$f"])
        if "$tuple" in node:
            return tuple(self.decode(v, depth) for v in node["$tuple"])
        if "$dict" in node:
            return {_hashable(self.decode(k, depth)): self.decode(v, depth) for k, v in node["$dict"]}
        return {k: self.decode(v, depth) for k, v in node.items()}


class MemoryBudgetError(ValueError):
    """A stored tree would decode to more than this process can hold."""


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def loads(data: bytes, budget: int | None = None) -> tuple[Any, dict[str, str]]:
    """``(tree, metadata)`` from the bytes :func:`dumps` wrote; reads with safetensors and json only.

    Counted on what it decodes to, not on its size: a tree of more than :data:`MAX_VALUES`
    values or :data:`MAX_DEPTH` levels is refused before its JSON is parsed, a tensor named
    twice is refused, and the copies decoding makes (``bytes``, numpy dtypes wider than what is
    stored) may total at most ``budget`` bytes (None: unbounded). Raises ValueError for bytes
    that are not such a file.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(bytes(data))
        # safetensors.torch.load gives no metadata; read it from the file's JSON header.
        length = int.from_bytes(data[:8], "little")
        header = json.loads(bytes(data[8 : 8 + length]))
        meta = header.get("__metadata__") or {}
        tree_text = meta[TREE_KEY].encode()
        depth, values = _shape_of(tree_text)
        if depth > MAX_DEPTH:
            raise ValueError(f"its tree nests deeper than {MAX_DEPTH} levels")
        if values > MAX_VALUES:
            raise ValueError(f"its tree holds over {MAX_VALUES:,} values (about {values:,})")
        encoded = json.loads(tree_text)
    except (SafetensorError, KeyError, ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise ValueError(f"not a stored tree ({type(exc).__name__}: {str(exc)[:200]})") from None
    try:
        tree = _Reader(tensors, budget).decode(encoded)
    except MemoryBudgetError as exc:
        raise ValueError(str(exc)) from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
        raise ValueError(f"its tree does not fit its tensors ({type(exc).__name__}: {str(exc)[:200]})") from None
    return tree, {k: v for k, v in meta.items() if k != TREE_KEY}
