"""The stage timeline read from a DEBUG log (``python -m epdserve.bench.timeline``)."""

from epdserve.bench.timeline import events, gaps, report

LOG = """\
2026-11-23 16:07:16,000 DEBUG epdserve.gateway: rid=a received (1 images)
2026-11-23 16:07:16,030 DEBUG epdserve.gateway: rid=a encoder answered
2026-11-23 16:07:16,040 DEBUG epdserve.prefill: rid=a prefilled 530 tokens (0 cached)
2026-11-23 16:07:16,100 DEBUG epdserve.gateway: rid=b received (1 images)
2026-11-23 16:07:16,152 DEBUG epdserve.prefill: rid=b prefilled 12 tokens (3 cached)
2026-11-23 16:07:16,150 DEBUG epdserve.gateway: rid=b encoder answered
2026-11-23 16:07:16,151 DEBUG epdserve.encoder: rid=b image 3fa2b9c0d1e2 decoded
2026-11-23 16:07:16,152 INFO epdserve.x: a line about no request
Traceback (most recent call last):
"""


def test_events_name_the_same_step_of_different_requests_alike():
    by_rid = events(LOG.splitlines())
    assert set(by_rid) == {"a", "b"}
    assert [name for _, name in by_rid["a"]] == ["received (N images)", "encoder answered",
                                                 "prefilled N tokens (N cached)"]
    assert ("image H decoded" in [name for _, name in by_rid["b"]])


def test_gaps_follow_time_not_log_order():
    rows = {(a, b): ms for a, b, ms, _ in gaps(events(LOG.splitlines()))}
    assert rows["received (N images)", "encoder answered"] == [30.0, 50.0]
    # b's prefill line was written before its encoder line but happened after it
    assert rows["image H decoded", "prefilled N tokens (N cached)"] == [1.0]
    assert rows["encoder answered", "prefilled N tokens (N cached)"] == [10.0]


def test_report_leaves_out_rare_pairs():
    text = report(events(LOG.splitlines()), min_share=0.6)
    assert "2 requests" in text and "received (N images) -> encoder answered" in text
    assert "image H decoded" not in text
