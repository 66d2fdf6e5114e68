"""The benchmark's ``--shapes`` items (CPU): indices into its SHAPES table or explicit shapes."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmark", "csa"))
import bench_csa_compressor as bench  # noqa: E402


@pytest.mark.L0
def test_index_and_explicit_shapes():
    assert bench.parse_shape("3") == bench.SHAPES[3]
    assert bench.parse_shape("1x16384x4x2x512") == (1, 16384, 4, 2, 512)
    assert bench.shape_name(bench.parse_shape("64x1000x4x2x128")) == "64x1000 r4 c2 d128"


@pytest.mark.L0
@pytest.mark.parametrize("item", ["1x2x3", "1x2x3x4x5x6"])
def test_malformed_shape_names_the_item(item):
    with pytest.raises(SystemExit, match=item):
        bench.parse_shape(item)
