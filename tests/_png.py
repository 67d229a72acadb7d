"""Minimal PNG reader/writer (zlib + numpy), so the report test checks real pixels without Pillow.

``read_png(path) -> uint8 array [height, width, channels]`` for 8-bit, non-interlaced greyscale,
RGB or RGBA images (what Chromium's ``--screenshot`` writes); ``write_png`` writes RGB(A) with
filter 0 (used to crop screenshots for viewing).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}


def _chunks(data: bytes):
    i = len(SIGNATURE)
    while i < len(data):
        (length,), kind = struct.unpack(">I", data[i:i + 4]), data[i + 4:i + 8]
        yield kind, data[i + 8:i + 8 + length]
        i += 12 + length


def read_png(path: str | Path) -> np.ndarray:
    data = Path(path).read_bytes()
    if not data.startswith(SIGNATURE):
        raise ValueError(f"{path} is not a PNG file")
    idat = []
    for kind, body in _chunks(data):
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
    if depth != 8 or interlace or color not in CHANNELS:
        raise ValueError(f"{path}: only 8-bit non-interlaced grey/RGB/RGBA PNGs are supported")
    bpp = CHANNELS[color]
    stride = width * bpp
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), np.uint8)
    prev = np.zeros(stride, np.int64)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int64)
        if kind == 0:
            cur = line
        elif kind == 2:
            cur = (line + prev) & 255
        elif kind == 1:  # Sub: a running sum per channel, mod 256
            cur = np.cumsum(line.reshape(width, bpp), axis=0).reshape(-1) & 255
        else:  # Average (3) and Paeth (4) depend on the reconstructed left pixel: sequential
            cur = np.zeros(stride, np.int64)
            f, up = line.tolist(), prev.tolist()
            c = cur.tolist()
            for x in range(stride):
                left = c[x - bpp] if x >= bpp else 0
                if kind == 3:
                    c[x] = (f[x] + (left + up[x]) // 2) & 255
                else:
                    ul = up[x - bpp] if x >= bpp else 0
                    p = left + up[x] - ul
                    pa, pb, pc = abs(p - left), abs(p - up[x]), abs(p - ul)
                    pred = left if pa <= pb and pa <= pc else (up[x] if pb <= pc else ul)
                    c[x] = (f[x] + pred) & 255
            cur = np.asarray(c, np.int64)
        out[y] = cur
        prev = cur
    return out.reshape(height, width, bpp)


def write_png(path: str | Path, pixels: np.ndarray) -> Path:
    pixels = np.ascontiguousarray(pixels, np.uint8)
    height, width, channels = pixels.shape
    color = {3: 2, 4: 6}[channels]
    rows = np.concatenate([np.zeros((height, 1), np.uint8), pixels.reshape(height, -1)], axis=1)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + \
            struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0)
    data = SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)) \
        + chunk(b"IEND", b"")
    Path(path).write_bytes(data)
    return Path(path)
