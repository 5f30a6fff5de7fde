"""The ``tiermem bench`` tables, pinned to the byte: fixed rows of ``bench activations``,
``stream``, ``lora`` and ``graphs`` print exactly the text they printed before the tables were
built by one helper (:mod:`tiermem.apps.table`), so a change in a column's title, width,
alignment, number format or the ``x``/parity columns fails here. The rows cover a missing
baseline (``x`` is ``-``), missing bytes (``-``), values wider than their column and a name
longer than the ``setup`` title."""

from __future__ import annotations

import pytest

from tiermem.apps import table
from tiermem.apps.bench import activations, graphs, lora, stream

ACTIVATIONS_ROWS = [
    activations.Row("no offload", 123.456, 3 * 2**30 + 5, None, (120.04, 130.96), "baseline"),
    activations.Row("no offload again", 124.5, 3 * 2**30, 0, (121.0, 128.0), "exact"),
    activations.Row("offload cpu (4 blocks: 0-3)", 99999.95, 2**30, 512 * 2**20,
                    (1.0, 123456.7), "WRONG (max |d| 1e-3)"),
]
ACTIVATIONS = [
    "setup                          ms/step         spread       x  peak GiB  moved MiB  "
    "parity",
    "no offload                       123.5    120.0-131.0   1.00x      3.00          -  "
    "baseline",
    "no offload again                 124.5    121.0-128.0   1.01x      3.00       0.00  "
    "exact",
    "offload cpu (4 blocks: 0-3)    99999.9   1.0-123456.7  810.00x      1.00     "
    "512.00  WRONG (max |d| 1e-3)",
]
ACTIVATIONS_NO_BASELINE = [
    "setup                          ms/step         spread       x  peak GiB  moved MiB  "
    "parity",
    "no offload again                 124.5    121.0-128.0       -      3.00       0.00  "
    "exact",
    "offload cpu (4 blocks: 0-3)    99999.9   1.0-123456.7       -      1.00     512.00  "
    "WRONG (max |d| 1e-3)",
]

STREAM_ROWS = [  # x: over the baseline at the row's clip; the ratio lines: same optimizer, clip
    stream.Row(stream.BASELINE, 250.0, (249.0, 251.5), 180.25, 12345.6, None, None,
               "baseline", vs_off=1.0),
    stream.Row(stream.STREAMED, 1250.55, (1200.0, 13000.25), 900.0, 1234567.8, 7 * 2**30,
               88.8, f"exact vs {stream.HOST_REF}; WRONG vs {stream.BASELINE}", vs_off=1.0),
    stream.Row(stream.BASELINE, 260.0, (259.0, 261.0), 180.0, 12000.0, None, None,
               "baseline", clip="1.0", vs_off=1.04),
    stream.Row(stream.HYBRID_REF, 520.0, (500.0, 530.0), 185.0, 6000.0, None, None,
               "equal (d=1.0e-05) vs resident, AdamW", clip="1.0", spec=(12, 12)),
    stream.Row(stream.HYBRID_STREAMED, 598.0, (590.0, 601.5), 203.5, 5000.0, 7 * 2**30,
               88.8, f"exact vs {stream.HYBRID_REF}; equal (d=1.0e-05) vs {stream.BASELINE}",
               clip="1.0", vs_off=1.5, spec=(0, 0)),
]
STREAM = [
    "setup                 clip    step ms           spread  fwd+bwd ms       x  vs off   "
    "tokens/s  streamed GiB  PCIe floor ms  spec/rb  parity",
    "resident, AdamW        off      250.0      249.0-251.5       180.2   1.00x   1.00x     "
    "12,346             -              -        -  baseline",
    "streamed, AdamW        off     1250.5   1200.0-13000.2       900.0   5.00x   1.00x  "
    "1,234,568         7.000           88.8        -  "
    "exact vs resident, AdamW on host copies; WRONG vs resident, AdamW",
    "resident, AdamW        1.0      260.0      259.0-261.0       180.0   1.00x   1.04x     "
    "12,000             -              -        -  baseline",
    "resident, HybridAdam   1.0      520.0      500.0-530.0       185.0   2.00x       -      "
    "6,000             -              -    12/12  equal (d=1.0e-05) vs resident, AdamW",
    "streamed, HybridAdam   1.0      598.0      590.0-601.5       203.5   2.30x   1.50x      "
    "5,000         7.000           88.8      0/0  "
    "exact vs resident, HybridAdam; equal (d=1.0e-05) vs resident, AdamW",
    "streamed vs resident, AdamW, clip off: 5.00x step, 4.99x fwd+bwd",
    "streamed vs resident, HybridAdam, clip 1.0: 1.15x step, 1.10x fwd+bwd",
]
STREAM_NO_BASELINE = [
    "setup            clip    step ms           spread  fwd+bwd ms       x  vs off   tokens/s  "
    "streamed GiB  PCIe floor ms  spec/rb  parity",
    "streamed, AdamW   off     1250.5   1200.0-13000.2       900.0       -   1.00x  1,234,568  "
    "       7.000           88.8        -  "
    "exact vs resident, AdamW on host copies; WRONG vs resident, AdamW",
]

LORA_ROWS = [
    lora.Row(512, "no offload", 50.0, (49.5, 50.5), 2**30, None, "baseline"),
    lora.Row(512, "offload", 75.25, (70.0, 80.0), 2**29, 3 * 2**20, "exact"),
    lora.Row(4096, "no offload", 0.0, (0.0, 0.0), None, None, "baseline"),
    lora.Row(131072, "offload + checkpoint", 400.0, (390.0, 410.0), 2**31, 2**26, "WRONG"),
]
LORA = [
    "   seq  setup                   ms/step           spread       x  peak GiB  "
    "moved MiB  parity",
    "   512  no offload                 50.0        49.5-50.5   1.00x      1.00          "
    "-  baseline",
    "   512  offload                    75.2        70.0-80.0   1.50x      0.50       "
    "3.00  exact",
    "  4096  no offload                  0.0          0.0-0.0       -         -          "
    "-  baseline",
    "131072  offload + checkpoint      400.0      390.0-410.0       -      2.00      "
    "64.00  WRONG",
]

GRAPHS_ROWS = [
    graphs.Row("eager", 10.0, 2.0, 12.0, (11.5, 12.5), "-", 1.0, 1.0, "baseline", []),
    graphs.Row("cuda graphs + compile", 5.5, 1.25, 6.75, (6.0, 7.0), "eager", 1.818, 1.777,
               "exact", []),
]
GRAPHS = [
    "setup                  fwd+bwd ms   optim ms    step ms         spread  "
    "speed-up fwd+bwd    step  against  parity",
    "eager                        10.0        2.0       12.0      11.5-12.5             "
    "1.00x   1.00x  -        baseline",
    "cuda graphs + compile         5.5        1.2        6.8        6.0-7.0             "
    "1.82x   1.78x  eager    exact",
]
GRAPHS_EMPTY = [
    "setup  fwd+bwd ms   optim ms    step ms         spread  speed-up fwd+bwd    step  "
    "against  parity",
]


def test_bench_activations_table_is_pinned():
    assert activations.format_table(ACTIVATIONS_ROWS).split("\n") == ACTIVATIONS
    assert activations.format_table(ACTIVATIONS_ROWS[1:]).split("\n") == ACTIVATIONS_NO_BASELINE


def test_bench_stream_table_is_pinned():
    assert stream.format_table(STREAM_ROWS).split("\n") == STREAM
    assert stream.format_table(STREAM_ROWS[1:2]).split("\n") == STREAM_NO_BASELINE


def test_bench_lora_table_is_pinned():
    assert lora.format_table(LORA_ROWS).split("\n") == LORA


def test_bench_graphs_table_is_pinned():
    assert graphs.format_table(GRAPHS_ROWS).split("\n") == GRAPHS
    assert graphs.format_table([]).split("\n") == GRAPHS_EMPTY


def test_short_setup_names_still_align_under_their_titles():
    """Setups all shorter than the ``setup`` title: the columns stay under their titles (the
    tables sized the name column by the names alone, so a header was two characters off)."""
    rows = [activations.Row("off", 10.0, None, None, (9.0, 11.0), "baseline")]
    header, line = activations.format_table(rows).split("\n")
    assert header.index("ms/step") + len("ms/step") == line.index("10.0") + len("10.0")
    assert line.endswith("  baseline")


def test_table_rejects_a_bad_column_or_row():
    with pytest.raises(ValueError, match=r"Column 'x': align='\^' must be '<' \(left\)"):
        table.Column("x", 6, "^")
    with pytest.raises(ValueError, match=r"Column 'x': width=-1 must be >= 0"):
        table.Column("x", -1)
    with pytest.raises(ValueError, match=r"has 1 cells for 2 columns \(a, b\)"):
        table.render([table.Column("a"), table.Column("b")], [("1",)])
