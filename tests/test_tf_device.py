"""TensorFlow on a GPU: refused, clearly. No machine we test on has TensorFlow with a GPU, so the
frontend offers no TensorFlow GPU path (docs/TENSORFLOW.md, "GPU"): a codec given a TensorFlow GPU
tensor, and a reducer, tape or optimizer asked for ``device_exchange=True``, raise an error that
names the limitation and that section. GPU gradients of the tape and optimizers take the host steps,
which these CPU tests cannot place on a GPU either."""
import re
from pathlib import Path

import numpy as np
import pytest

import tensorflow as tf

import hvd_quant
from hvd_quant import dispatch
from hvd_quant.tensorflow import _backend

pytestmark = pytest.mark.tensorflow

ROOT = Path(__file__).resolve().parents[1]
GPU = "/job:localhost/replica:0/task:0/device:GPU:0"


def _names_the_doc(message):
    assert "never run" in message and 'docs/TENSORFLOW.md, "GPU"' in message, message


class _OnGpu:
    """What the frontend reads of a TensorFlow GPU tensor: its device string (a real one cannot be
    made without a GPU)."""
    device = GPU


def test_the_tensorflow_frontend_refuses_gpu_tensors():
    with pytest.raises(hvd_quant.UnsupportedInputError) as e:
        _backend.FRONTEND.adapter(_OnGpu())
    _names_the_doc(str(e.value))
    with tf.device("/cpu:0"):
        x = tf.constant(np.arange(8, dtype=np.float32))
    assert not _backend.FRONTEND.adapter(x).device                  # CPU tensors: the host adapter
    assert dispatch.frontend_for(x) is _backend.FRONTEND


def test_codecs_refuse_a_tensorflow_gpu_tensor(monkeypatch):
    """Through the public encode, as a user would meet it (the tensor's device made a GPU's)."""
    x = tf.constant(np.arange(8, dtype=np.float32))
    monkeypatch.setattr(type(x), "device", property(lambda self: GPU))
    with pytest.raises(hvd_quant.UnsupportedInputError) as e:
        hvd_quant.QSGD(bits=4).encode(x)
    _names_the_doc(str(e.value))


@pytest.mark.parametrize("make", ["reducer", "tape"])
def test_device_exchange_is_refused(make):
    import hvd_quant.tensorflow as hqt
    with pytest.raises(ValueError) as e:
        if make == "reducer":
            hqt.GradientReducer(compression=hvd_quant.QSGD(bits=4), device_exchange=True)
        else:
            hqt.DistributedGradientTape(tf.GradientTape(), compression=hvd_quant.QSGD(bits=4),
                                        device_exchange=True)
    _names_the_doc(str(e.value))


def test_the_named_doc_section_states_the_untested_surface():
    doc = (ROOT / "docs" / "TENSORFLOW.md").read_text()
    assert re.search(r"^## GPU$", doc, re.M), "the section the errors name"
    section = doc.split("\n## GPU\n", 1)[1].split("\n## ", 1)[0]
    for what in ("never run", "device_exchange", "host steps", "Untested surface"):
        assert what in section, what
