"""Hypothesis strategies shared by the codec tests: rows of the shapes embedding tables have, and worse."""

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cnrstore.codecs.lossless import FP16_MAX

dims = st.one_of(st.integers(1, 9), st.sampled_from([15, 16, 17, 31, 63, 64, 65, 127, 128, 255, 1023, 1024]))


@st.composite
def row_batches(draw, max_abs=1e4, min_exp=-30.0, max_rows=6):
    """(n, dim) float32 rows of assorted shapes: Gaussian at magnitudes 10**[min_exp, 4], an offset far
    from zero, constant rows, a single outlier, mixed signs, values pinned to +-max_abs, Student-t."""
    n = draw(st.integers(1, max_rows))
    dim = draw(dims)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = 10.0 ** draw(st.floats(min_exp, 4.0))
    kind = draw(st.sampled_from(["gauss", "offset", "constant", "outlier", "positive", "mixed", "edge", "t"]))
    x = rng.standard_normal((n, dim)) * scale
    if kind == "offset":
        x += rng.choice([-1, 1], size=(n, 1)) * 10.0 ** draw(st.floats(min_exp, 4.0))
    elif kind == "constant":
        x[:] = x[:, :1]
    elif kind == "outlier":
        x[np.arange(n), rng.integers(0, dim, n)] *= 10.0 ** draw(st.floats(1, 6))
    elif kind == "positive":
        x = np.abs(x) + scale
    elif kind == "mixed":
        x *= 10.0 ** rng.uniform(-3, 3, size=(n, dim))
    elif kind == "edge":
        x[:, 0] = max_abs * rng.choice([-1, 1], size=n)
    elif kind == "t":
        x = rng.standard_t(2, size=(n, dim)) * scale
    return np.clip(x, -max_abs, max_abs).astype(np.float32)


def raw_rows(max_abs=FP16_MAX, max_dim=9):
    """Arbitrary float32 values, subnormals and signed zeros included."""
    return hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 5), st.integers(1, max_dim)),
        elements=st.floats(-max_abs, max_abs, width=32, allow_subnormal=True),
    )
