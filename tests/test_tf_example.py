"""examples/tensorflow/train_keras.py a few steps under ``horovodrun -np 2`` (Gloo): it trains, prints
on rank 0 only (progress as whole lines, no carriage-return fragments), and reports fewer bytes per step than fp32."""
import re

import pytest

from launch import ROOT, run_horovod
from test_examples import tensorboard_scalars

pytestmark = [pytest.mark.multiproc, pytest.mark.tensorflow]

SCRIPT = ROOT / "examples" / "tensorflow" / "train_keras.py"


# One codec: what is proved here is the example's plumbing (arguments, rank-0 output, progress lines,
# measured bytes against the formula, TensorBoard). Every codec and both reductions go through the
# TensorFlow frontend's own jobs (tests/test_tf_frontend.py, tests/test_tf_elastic.py).
@pytest.mark.parametrize("spec,reduction,min_ratio", [
    # 4-bit, bucket 512: 32 / (4 + 32/512) = 7.9x on the compressed tensors; the CNN's 906 fp32
    # elements (biases, the 3x3x1x16 first convolution, the 64x10 head) bring it to ~7x.
    pytest.param("qsgd:bits=4,bucket_size=512", "sra", 6.0, id="qsgd4-sra"),
])
def test_keras_example_runs_under_horovodrun(spec, reduction, min_ratio, tmp_path):
    result = run_horovod(SCRIPT, np=2, controller="gloo", timeout=300, args=[
        "--compression", spec, "--reduction", reduction, "--epochs", "2", "--max-steps", "8",
        "--train-size", "1536", "--log-every", "4", "--tensorboard", str(tmp_path / "tb")],
        keep_cr=True)
    out, err = result.stdout, result.stderr
    assert re.search(r"^\[0\]<stdout>:world size 2, codec " + re.escape(spec.split(":")[0]), out, re.M), out
    assert not re.search(r"^\[1\]<stdout>:", out, re.M), "only rank 0 prints"
    assert re.search(r"^\[0\]<stdout>:Step4: [\d.]+ data/sec", out, re.M), out
    assert re.search(r"Epoch 0 in [\d.]+ sec, test time [\d.]+ sec, test accuracy:[\d.]+", out), out
    assert re.search(r"^\[0\]<stderr>:cnn epoch 0: \d+/\d+ steps \(\d+%\), [\d.]+ steps/s, ", err, re.M) \
        and not re.search(r"^\[1\]<stderr>:.*cnn epoch", err, re.M), "progress lines on rank 0 only"
    assert "\r" not in out and "\r" not in err, "no progress-bar fragments under horovodrun"
    m = re.search(r"bytes sent in the last step, measured by hvd_quant: .* \(([\d.]+)x less\)", out)
    assert m and float(m.group(1)) >= min_ratio, out[-2000:]
    est = re.search(r"bytes sent per step \(formula\): .*\(([\d.]+)x less", out)
    assert est and abs(float(est.group(1)) - float(m.group(1))) / float(m.group(1)) < 0.05, out[-2000:]
    tags = tensorboard_scalars(tmp_path / "tb" / "cnn")       # rank 0's tf.summary scalars
    assert [s for s, _ in tags["train/loss"]] == [4, 8], tags.get("train/loss")
    assert all(v >= min_ratio for _, v in tags["exchange/ratio"]) and tags["exchange/seconds"]
    # each epoch's test pass at the global step it ended on (1,536 images: 768 a rank in batches of
    # 128 make 6 steps per epoch; --max-steps 8)
    assert [s for s, _ in tags["test/accuracy"]] == [6, 8], tags.get("test/accuracy")


def test_docs_snippets_run_under_horovodrun(tmp_path):
    """Every ```python block of docs/TENSORFLOW.md, each in its own namespace, in one 2-rank job."""
    text = (ROOT / "docs" / "TENSORFLOW.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 4
    script = tmp_path / "tf_doc_snippets.py"
    script.write_text(
        "import os, sys\nos.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')\n"
        f"BLOCKS = {blocks!r}\n"
        "for i, src in enumerate(BLOCKS):\n"
        "    exec(compile(src, f'TENSORFLOW.md block {i}', 'exec'), {'__name__': '__main__'})\n"
        "    print(f'SNIPPET {i} ok', flush=True)\n")
    result = run_horovod(script, np=2, controller="gloo", timeout=300)
    for i in range(len(blocks)):
        assert result.stdout.count(f"SNIPPET {i} ok") == 2, result.stdout[-3000:]
    assert "hidden/kernel:0" in result.stdout
