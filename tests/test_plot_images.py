"""``purestep.plot.image_grid`` and ``write_png``: tile placement, scaling, and PNG files that
an independent decoder (Pillow) reads back pixel for pixel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from purestep import plot


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 7),
    channels=st.sampled_from([0, 1, 3]),
    h=st.integers(1, 4),
    w=st.integers(1, 4),
    ncol=st.one_of(st.none(), st.integers(1, 8)),
    pad=st.integers(0, 2),
    seed=st.integers(0, 99),
)
def test_each_image_lands_scaled_in_its_tile_and_the_rest_is_padding(
    n: int, channels: int, h: int, w: int, ncol: int | None, pad: int, seed: int
) -> None:
    """Tile i at (i // ncol, i % ncol) holds round((x + 1) / 2 * 255) of image i; every other
    pixel is pad_value."""
    g = torch.Generator().manual_seed(seed)
    shape = (n, h, w) if channels == 0 else (n, channels, h, w)
    x = torch.rand(shape, generator=g) * 2.4 - 1.2  # some values outside [-1, 1]: clamped
    grid = plot.image_grid(x, ncol=ncol, pad=pad, pad_value=7)
    cols = ncol or int(torch.tensor(n).sqrt().ceil())
    rows = -(-n // cols)
    color = channels == 3
    assert grid.shape[:2] == (rows * (h + pad) + pad, cols * (w + pad) + pad)
    assert grid.dim() == (3 if color else 2)
    covered = torch.zeros(grid.shape[:2], dtype=torch.bool)
    for i in range(n):
        r, c = divmod(i, cols)
        top, left = pad + r * (h + pad), pad + c * (w + pad)
        img = x[i].permute(1, 2, 0) if color else (x[i, 0] if channels == 1 else x[i])
        want = ((img + 1) / 2 * 255).round().clamp(0, 255).to(torch.uint8)
        assert torch.equal(grid[top : top + h, left : left + w], want)
        covered[top : top + h, left : left + w] = True
    assert bool((grid[~covered] == 7).all())


@pytest.mark.parametrize("color", [False, True])
def test_write_png_is_read_back_pixel_for_pixel(tmp_path: Path, color: bool) -> None:
    """Pillow decodes write_png's file to the same pixels (grayscale and RGB)."""
    image_mod = pytest.importorskip("PIL.Image")
    g = torch.Generator().manual_seed(0)
    shape = (5, 7, 3) if color else (5, 7)
    img = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    path = plot.write_png(img, tmp_path / "sub" / "x.png")
    with image_mod.open(path) as im:
        assert im.mode == ("RGB" if color else "L") and im.size == (7, 5)
        back = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).reshape(shape)
    assert torch.equal(back, img)


def test_bad_images_are_refused_naming_the_shape() -> None:
    with pytest.raises(ValueError, match=r"\(2, 2, 3, 3\)"):
        plot.image_grid(torch.zeros(2, 2, 3, 3))
    with pytest.raises(ValueError, match="no images"):
        plot.image_grid(torch.zeros(0, 3, 3))
    with pytest.raises(ValueError, match="ncol"):
        plot.image_grid(torch.zeros(2, 3, 3), ncol=0)
    with pytest.raises(ValueError, match=r"torch.float32 \(2, 2\)"):
        plot.write_png(torch.zeros(2, 2), "unused.png")


def test_write_png_replaces_a_file_atomically_and_leaves_no_scratch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails part-way (here: at fsync) leaves the previous image intact and no
    scratch file behind; a successful write replaces it whole."""
    import os

    path = tmp_path / "x.png"
    first = plot.write_png(torch.zeros(2, 2, dtype=torch.uint8), path).read_bytes()

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", broken_fsync)
        with pytest.raises(OSError, match="No space"):
            plot.write_png(torch.full((3, 3), 255, dtype=torch.uint8), path)
    assert path.read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.png"]
    second = plot.write_png(torch.full((3, 3), 255, dtype=torch.uint8), path).read_bytes()
    assert second != first
