import json

from rlbus.obs.sinks import JsonlSink


def test_a_torn_last_line_is_cut_before_the_next_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')  # the writer was killed mid-row
    sink = JsonlSink(path)
    sink.write({"step": 2, "loss": 0.5})
    sink.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1},
        {"step": 2, "loss": 0.5},
    ]
