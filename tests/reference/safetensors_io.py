"""Minimal safetensors reader/writer for torch 1.13 (which has no safetensors package here).

Written independently of the C++ side so that the tests check one against the other.
"""
import json
import struct

import numpy as np

_NUMPY = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "I64": np.int64, "U8": np.uint8}


def load_raw(path):
    """name -> (dtype name, shape, raw bytes), without torch (fast to import)."""
    with open(path, "rb") as f:
        blob = f.read()
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + header_len])
    data = blob[8 + header_len :]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        out[name] = (entry["dtype"], entry["shape"], data[begin:end])
    return out


def load_numpy(path):
    """name -> numpy array (every dtype but BF16, which numpy lacks)."""
    out = {}
    for name, (dtype, shape, raw) in load_raw(path).items():
        if dtype not in _NUMPY:
            raise ValueError(f"{path}: tensor {name}: dtype {dtype} has no numpy type")
        out[name] = np.frombuffer(raw, dtype=_NUMPY[dtype]).reshape(shape)
    return out


def load(path):
    import torch  # here, so that load_numpy's users do not pay for importing torch

    out = {}
    for name, (dtype, shape, raw) in load_raw(path).items():
        if dtype == "BF16":
            bits = np.frombuffer(raw, dtype=np.uint16).astype(np.int32) << 16
            tensor = torch.from_numpy(bits.view(np.float32).copy()).to(torch.bfloat16)
        elif dtype in _NUMPY:
            tensor = torch.from_numpy(np.frombuffer(raw, dtype=_NUMPY[dtype]).copy())
        else:
            raise ValueError(f"{path}: tensor {name}: dtype {dtype} not supported by the reader")
        out[name] = tensor.reshape(shape)
    return out


def save(path, tensors):
    import torch

    header = {}
    chunks = []
    offset = 0
    for name, tensor in tensors.items():
        tensor = tensor.detach().contiguous().cpu()
        if tensor.dtype == torch.bfloat16:
            bits = tensor.float().numpy().view(np.uint32) >> 16
            raw = bits.astype(np.uint16).tobytes()
            dtype = "BF16"
        else:
            array = tensor.numpy()
            dtype = {np.float32: "F32", np.float16: "F16", np.int32: "I32", np.int64: "I64",
                     np.uint8: "U8"}[array.dtype.type]
            raw = array.tobytes()
        header[name] = {"dtype": dtype, "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in chunks:
            f.write(raw)
