"""Write tests/fixtures/tensorboard/ with TensorBoard's own Python writer (no TensorFlow needed).

    python3 -m venv /tmp/tb && /tmp/tb/bin/pip install tensorboard
    /tmp/tb/bin/python scripts/make_tensorboard_fixture.py             # regenerate the fixture
    /tmp/tb/bin/python scripts/make_tensorboard_fixture.py --check DIR # read attnlab's event file(s) in DIR
                                                                       # with TensorBoard's EventAccumulator

Files:
- events.out.tfevents.fixture: EventFileWriter (the writer torch.utils.tensorboard uses), with
  simple_value scalars (as PyTorch's SummaryWriter.add_scalar writes them), several values in one
  event, and tf.summary-v2-style tensor scalars (tensorboard.plugins.scalar.summary_v2.scalar_pb).
- events.out.tfevents.simple: TensorBoard's RecordWriter with fixed wall times, for a byte-for-byte
  comparison with attnlab's encoder.
- expected.json: tag -> [[step, value], ...] as written.
"""
import json
import os
import sys

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.scalar import summary_v2
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.summary.writer.record_writer import RecordWriter

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "tensorboard")


def simple(tag, value):
    return summary_pb2.Summary.Value(tag=tag, simple_value=value)


def make():
    os.makedirs(OUT, exist_ok=True)
    for f in os.listdir(OUT):
        if "tfevents" in f:
            os.remove(os.path.join(OUT, f))
    expected = {}

    def note(tag, step, value):
        expected.setdefault(tag, []).append([step, value])

    w = EventFileWriter(OUT)
    for step in range(1, 6):
        loss = 10.0 / step
        w.add_event(event_pb2.Event(wall_time=1000.5 + step, step=step, summary=summary_pb2.Summary(value=[simple("simple/loss", loss)])))
        note("simple/loss", step, loss)
    for step in (2, 4):
        vals = [simple("train/lr", 0.001 * step), simple("eval/wiki/ppl", 30.0 + step)]
        w.add_event(event_pb2.Event(wall_time=2000.0 + step, step=step, summary=summary_pb2.Summary(value=vals)))
        note("train/lr", step, 0.001 * step)
        note("eval/wiki/ppl", step, 30.0 + step)
    for step in (10, 20, 30):
        w.add_event(event_pb2.Event(wall_time=3000.0 + step, step=step, summary=summary_v2.scalar_pb("v2/acc", 0.25 * step / 10)))
        note("v2/acc", step, 0.25 * step / 10)
    w.close()
    (name,) = [f for f in os.listdir(OUT) if f.startswith("events.out.tfevents.")]
    os.rename(os.path.join(OUT, name), os.path.join(OUT, "events.out.tfevents.fixture"))

    with open(os.path.join(OUT, "events.out.tfevents.simple"), "wb") as f:
        r = RecordWriter(f)
        r.write(event_pb2.Event(wall_time=1000.0, file_version="brain.Event:2").SerializeToString())
        for step, loss in expected["simple/loss"]:
            r.write(event_pb2.Event(wall_time=1000.5 + step, step=step, summary=summary_pb2.Summary(value=[simple("simple/loss", loss)])).SerializeToString())
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    print("wrote", OUT)


def check(d):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(d, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    if not tags:
        sys.exit(f"{d}: EventAccumulator found no scalars")
    for t in sorted(tags):
        ev = acc.Scalars(t)
        steps = [e.step for e in ev]
        assert steps == sorted(set(steps)), f"{t}: steps not strictly increasing: {steps}"
        print(f"{t:40} {len(ev):5} points, steps {steps[0]}..{steps[-1]}, last {ev[-1].value:.6g}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        check(sys.argv[2])
    else:
        make()
