"""A dependency-free heatmap PNG (zlib + struct): one panel per mode, rows = needle depths,
columns = context lengths, colour = accuracy (red 0 -> yellow 0.5 -> green 1, grey = no data).
When Pillow happens to be installed, titles and axis labels are drawn on top; without it the
image has the cells only (the Markdown report carries the numbers either way)."""
from __future__ import annotations

import struct
import zlib
from typing import Sequence

CELL, GAP, PAD, TITLE, LABEL_W, LABEL_H = 36, 2, 12, 18, 44, 16
WHITE, GREY, BLACK = (255, 255, 255), (200, 200, 200), (0, 0, 0)
RED, YELLOW, GREEN = (215, 48, 39), (254, 224, 139), (26, 152, 80)


def colour(value: float | None) -> tuple[int, int, int]:
    if value is None:
        return GREY
    v = min(1.0, max(0.0, float(value)))
    lo, hi, t = (RED, YELLOW, v / 0.5) if v < 0.5 else (YELLOW, GREEN, (v - 0.5) / 0.5)
    return tuple(int(round(a + (b - a) * t)) for a, b in zip(lo, hi))


def png_bytes(pixels: list[bytearray], width: int, height: int) -> bytes:
    """RGB rows -> PNG file bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def heatmap_png(panels: Sequence[tuple[str, list[list[float | None]]]], row_labels: Sequence[str],
                col_labels: Sequence[str], title: str = "") -> bytes:
    """panels: (name, grid[row][col]) -> PNG bytes."""
    rows, cols = len(row_labels), len(col_labels)
    pw = LABEL_W + cols * (CELL + GAP)
    ph = TITLE + rows * (CELL + GAP) + LABEL_H
    width = PAD + len(panels) * (pw + PAD)
    top = PAD + (TITLE if title else 0)
    height = top + ph + PAD
    pixels = [bytearray(WHITE * width) for _ in range(height)]
    boxes = []  # text to draw: (x, y, text)
    if title:
        boxes.append((PAD, PAD // 2, title))
    for p, (name, grid) in enumerate(panels):
        x0 = PAD + p * (pw + PAD)
        boxes.append((x0 + LABEL_W, top + 2, name))
        for r in range(rows):
            y = top + TITLE + r * (CELL + GAP)
            boxes.append((x0, y + CELL // 2 - 6, row_labels[r]))
            for c in range(cols):
                value = grid[r][c] if r < len(grid) and c < len(grid[r]) else None
                rgb = bytes(colour(value))
                x = x0 + LABEL_W + c * (CELL + GAP)
                for yy in range(y, y + CELL):
                    pixels[yy][3 * x: 3 * (x + CELL)] = rgb * CELL
                if value is not None:
                    boxes.append((x + 4, y + CELL // 2 - 6, f"{value:.2f}"))
        for c in range(cols):
            boxes.append((x0 + LABEL_W + c * (CELL + GAP), top + TITLE + rows * (CELL + GAP) + 2, col_labels[c]))
    data = png_bytes(pixels, width, height)
    return _with_labels(data, boxes) or data


def _with_labels(data: bytes, boxes) -> bytes | None:
    """Draw the text boxes with Pillow when it is installed; None otherwise."""
    try:
        import io

        from PIL import Image, ImageDraw
    except ImportError:
        return None
    try:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        draw = ImageDraw.Draw(image)
        for x, y, text in boxes:
            draw.text((x, y), text, fill=BLACK)
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()
    except Exception:  # labels are a nicety; never fail the bench for them
        return None


def needle_heatmap(result: dict) -> bytes:
    """The needle bench's accuracy grid as a PNG."""
    lengths = [str(n) for n in result["settings"]["lengths"]]
    depths = [f"{d:g}" for d in result["settings"]["depths"]]
    panels = []
    for mode in result["modes"]:
        grid = result["accuracy"][mode["label"]]
        panels.append((mode["label"], [[grid[n][d] for n in lengths] for d in depths]))
    return heatmap_png(panels, [f"d={d}" for d in depths], lengths, "pass-key accuracy: rows depth, columns tokens")
