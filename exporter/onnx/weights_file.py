"""The graph's weights file, written one weight at a time: what lets export convert a 7B checkpoint in bounded memory.

Each array is appended to the file and becomes an initializer that references it through ONNX's external data
(`location`, `offset`, `length`: onnx.external_data_helper's own fields, which ONNX Runtime maps), so no model
proto ever holds the data (protobuf refuses anything over 2 GiB). The layout is the one `onnx.save_model(...,
save_as_external_data=True, all_tensors_to_one_file=True, size_threshold=0)` writes for a model holding the
arrays: every initializer in the order the graph lists them, back to back.

`StreamedWeights` is the `initializer` an OnnxBuilder pulls from: the model definition's first read of a weight
converts its graph weight (checkpoint tensors read, quantized, fused), writes the part read, and keeps only the
parts the graph reads later until then.
"""
from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator, Mapping

import numpy as np
import onnx
from onnx.external_data_helper import set_external_data

from .graph_builder import onnx_type
from ...graphs.weights import weight_arrays
from ...graphs.quant import Weight, WeightForm, form_of


class NonFiniteWeight(ValueError):
    """A checkpoint tensor holds NaN or Inf: nothing served from it could be trusted."""


def external_tensor(name: str, dtype: np.dtype, shape: tuple[int, ...], location: str, offset: int,
                    length: int) -> onnx.TensorProto:
    """An initializer whose data lies in `location` at `offset` (what onnx.save_model leaves in the graph)."""
    tensor = onnx.TensorProto(name=name, dims=list(shape), data_type=onnx_type(dtype), raw_data=b"")
    set_external_data(tensor, location, offset, length)  # needs raw_data set, as after from_array
    tensor.ClearField("raw_data")
    return tensor


class WeightsFile:
    """An external-data file being appended to; `append` returns the initializer that references what it wrote."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = 0
        self._file: BinaryIO = open(path, "wb")

    def append(self, name: str, array: np.ndarray) -> onnx.TensorProto:
        data = np.ascontiguousarray(array)
        data.tofile(self._file)
        offset, self.size = self.size, self.size + data.nbytes
        return external_tensor(name, data.dtype, data.shape, self.path.name, offset, data.nbytes)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "WeightsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_finite(name: str, sources: Iterable[str], arrays: Mapping[str, np.ndarray]) -> None:
    """Refuse a graph weight with NaN or Inf in its float data, naming the checkpoint tensors it came from."""
    for array in arrays.values():
        if array.dtype.kind in "iub" or not array.size:
            continue
        with np.errstate(invalid="ignore"):  # min and max carry a NaN through, and show an Inf: no full-size mask
            if np.isfinite(array.min()) and np.isfinite(array.max()):
                continue
        raise NonFiniteWeight(f"checkpoint tensor(s) {', '.join(sources)} (graph weight {name}) hold NaN or Inf: the "
                              "checkpoint is corrupt or was saved from a diverged run; re-download or re-convert it")


class StreamedWeights:
    """Graph weights converted when the graph first reads them, written to `out`, and dropped.

    `convert(name)` makes one graph weight (graphs/weights.py's graph_weight over the checkpoint's tensors); `sources` names the
    checkpoint tensors of each (for errors); `done(name)` is called after each conversion (a progress bar).
    `forms` is the Mapping a `WeightForms` reads: asking for a weight's form converts it too."""

    def __init__(self, sources: Mapping[str, tuple[str, ...]], convert: Callable[[str], Weight], out: WeightsFile,
                 done: Callable[[str], None] = lambda name: None) -> None:
        self.sources, self._convert, self._out, self._done = sources, convert, out, done
        self._forms: dict[str, WeightForm] = {}
        self._pending: dict[str, np.ndarray] = {}
        self.written: dict[str, onnx.TensorProto] = {}  # every initializer written, in file order
        self.nbytes: dict[str, int] = {}  # bytes written per graph weight
        self.forms: Mapping[str, WeightForm] = _Forms(self)

    def form(self, name: str) -> WeightForm:
        if name not in self._forms:
            self._load(name)
        return self._forms[name]

    def known_forms(self) -> dict[str, WeightForm]:
        """The forms of the graph weights converted so far."""
        return dict(self._forms)

    def initializer(self, part: str) -> onnx.TensorProto:
        if part not in self.written:
            owner = self._owner(part)
            if part not in self._pending:
                self._load(owner)
            array = self._pending.pop(part)
            self.written[part] = self._out.append(part, array)
            self.nbytes[owner] = self.nbytes.get(owner, 0) + array.nbytes
        return self.written[part]

    def _owner(self, part: str) -> str:
        owner = part if part in self.sources else part.rsplit(".", 1)[0]
        if owner not in self.sources or (owner in self._forms and part not in self._pending):
            raise KeyError(f"{part}: not a weight of this model's graph")
        return owner

    def _load(self, name: str) -> None:
        w = self._convert(name)
        arrays = weight_arrays(name, w)
        check_finite(name, self.sources[name], arrays)
        self._forms[name] = form_of(w)
        self._pending.update(arrays)
        self._done(name)


class _Forms(Mapping[str, WeightForm]):
    def __init__(self, store: StreamedWeights) -> None:
        self._store = store

    def __getitem__(self, name: str) -> WeightForm:
        if name not in self._store.sources:
            raise KeyError(name)
        return self._store.form(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._store.sources)

    def __len__(self) -> int:
        return len(self._store.sources)
