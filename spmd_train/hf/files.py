"""A Hugging Face checkpoint directory's safetensors files, read one tensor at a time with `safetensors`."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy reader then returns)
import numpy as np
from safetensors import safe_open

from spmd_train.errors import ConfigError
from spmd_train.hf.mxfp4 import BLOCKS, SCALES, dequantize, dequantized_shape

INDEX = "model.safetensors.index.json"
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


class SafetensorsDir:
    """The tensors of DIR/*.safetensors (through DIR/model.safetensors.index.json when there is one).

    Only headers are read when opened; `tensor(name)` reads that one tensor from disk. An MXFP4-packed tensor
    (NAME_blocks with NAME_scales: gpt-oss's experts) is listed and read as NAME, dequantized to bfloat16.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise ConfigError(f"{index} is not a safetensors index (a JSON object with a weight_map): {err}") \
                    from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.directory / f).is_file()]
            if missing:
                raise ConfigError(f"{index} names files that are not in {self.directory}: {', '.join(missing)}")
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                raise ConfigError(f"{self.directory} has no *.safetensors weights (valid: a Hugging Face checkpoint "
                                  "saved with safe_serialization; .bin/.pt pickles are not read)")
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        self._file: dict[str, Path] = {}
        for name in files:
            path = self.directory / name
            try:
                with safe_open(path, framework="np") as f:
                    for key in f.keys():
                        s = f.get_slice(key)
                        self.shapes[key], self.dtypes[key] = tuple(s.get_shape()), s.get_dtype()
                        self._file[key] = path
            except (OSError, Exception) as err:  # safetensors raises its own SafetensorError for a damaged header
                if isinstance(err, ConfigError):
                    raise
                raise ConfigError(f"{path} is not a readable safetensors file: {err}") from None
        self._packed: dict[str, tuple[str, str]] = {}
        for key in [k for k in self.shapes if k.endswith(BLOCKS) and k[: -len(BLOCKS)] + SCALES in self.shapes]:
            name = key[: -len(BLOCKS)]
            self._packed[name] = (key, name + SCALES)
            self.shapes[name], self.dtypes[name] = dequantized_shape(self.shapes[key]), "BF16"
            for part in self._packed[name]:
                del self.shapes[part], self.dtypes[part]

    def tensor(self, name: str) -> np.ndarray:
        """One tensor as a numpy array in its stored dtype (bfloat16 through ml_dtypes; a packed one dequantized)."""
        if name in self._packed:
            try:
                return dequantize(*(self.tensor(part) for part in self._packed[name]))
            except ValueError as err:
                raise ConfigError(f"{name} in {self.directory}: {err}") from None
        with safe_open(self._file[name], framework="np") as f:
            return f.get_tensor(name)

    def dtype(self) -> str:
        """The dtype most of the bytes are stored in (float32, bfloat16, float16)."""
        sizes: dict[str, int] = {}
        for key, shape in self.shapes.items():
            sizes[self.dtypes[key]] = sizes.get(self.dtypes[key], 0) + int(np.prod(shape))
        stored = max(sizes, key=sizes.get)
        return _DTYPES.get(stored, stored.lower())

    def largest_bytes(self) -> int:
        """Bytes of the largest tensor (what reading one at a time holds at most)."""
        return max(int(np.prod(s)) * np.dtype(_DTYPES.get(self.dtypes[k], "float32")).itemsize
                   for k, s in self.shapes.items())
