"""executor.partime.video: the seeded synthetic stream is a few moving plane waves per channel, moves at most as fast
as its drift allows, cuts where asked, is the same in another process, and refuses bad values."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from executor.partime import video
from executor.partime.video import IN_CHANNELS, MAX_FRAME_ELEMENTS, WAVES, VideoSpec, frame, scene_of
from sim.core.errors import SpecError

ROOT = Path(__file__).resolve().parents[3]


def test_shapes_dtypes_and_the_target_range():
    x, y = frame(VideoSpec(size=12, features=5, seed=3), 7)
    assert x.shape == (1, IN_CHANNELS, 12, 12) and y.shape == (1, 5, 12, 12)
    assert x.dtype == y.dtype == torch.float32
    assert float(y.min()) > 0.0 and float(y.max()) < 1.0  # a sigmoid: reachable by the cnn's last ReLU


def test_same_spec_and_frame_give_identical_tensors_and_the_seed_matters():
    spec = VideoSpec(size=16, features=4, seed=11, drift=0.1)
    x1, y1 = frame(spec, 5)
    frame(spec, 9)  # making other frames in between changes nothing: no state
    x2, y2 = frame(spec, 5)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    other_x, _ = frame(VideoSpec(size=16, features=4, seed=12, drift=0.1), 5)
    assert not torch.equal(x1, other_x)


#: Prints a hash of frames 0-3 of one stream: run here and in a fresh one-thread process.
DIGEST = """
import hashlib
from executor.partime.video import VideoSpec, frame
h = hashlib.sha256()
for f in range(4):
    for t in frame(VideoSpec(size=20, features=6, seed=4, drift=0.3, cut_at=2), f):
        h.update(t.numpy().tobytes())
print(h.hexdigest())
"""


def test_another_process_with_one_thread_makes_the_same_bytes(capsys):
    done = subprocess.run([sys.executable, "-c", "import torch; torch.set_num_threads(1)\n" + DIGEST],
                          capture_output=True, text=True, timeout=120, check=True, cwd=ROOT)
    exec(DIGEST, {})
    assert done.stdout == capsys.readouterr().out and len(done.stdout) == 65


def test_each_channel_is_a_sum_of_at_most_WAVES_plane_waves():
    # a plane wave of integer frequency (u, v) over the S x S grid is two coefficients of the 2-D DFT, (u, v) and
    # (-u, -v): a channel has at most 2 * WAVES nonzero coefficients, whatever the frame
    spec = VideoSpec(size=32, features=2, seed=5, drift=0.2)
    for f in (0, 13):
        x64 = video._scene_image(spec, 0, f)
        for channel in x64:
            spectrum = torch.fft.fft2(channel).abs()
            assert int((spectrum > 1e-9 * float(spectrum.max())).sum()) <= 2 * WAVES


@pytest.mark.parametrize("drift", [0.01, 0.2])
def test_consecutive_frames_differ_by_at_most_the_drift_bound(drift):
    # |sin(a + d) - sin(a)| <= |d|; every wave's phase moves by at most 1.5 * drift, and the amplitudes of a channel
    # satisfy sum a_k^2 = 2, so sum a_k <= sqrt(2 * WAVES) (Cauchy-Schwarz): max |x_{f+1} - x_f| <= that product
    spec = VideoSpec(size=24, features=3, seed=6, drift=drift)
    bound = 1.5 * drift * math.sqrt(2 * WAVES) + 1e-5  # + fp32 rounding of the two frames
    steps = [float((frame(spec, f + 1)[0] - frame(spec, f)[0]).abs().max()) for f in range(6)]
    assert max(steps) <= bound
    assert min(steps) > 0.0  # the scene does move


def test_zero_drift_is_a_still_image():
    spec = VideoSpec(size=8, features=3, seed=2, drift=0.0)
    x0, y0 = frame(spec, 0)
    for f in (1, 17, 400):
        x, y = frame(spec, f)
        assert torch.equal(x, x0) and torch.equal(y, y0)


def test_the_cut_changes_the_scene_from_its_frame_on_and_nothing_before():
    plain = VideoSpec(size=16, features=3, seed=8, drift=0.05)
    cut = VideoSpec(size=16, features=3, seed=8, drift=0.05, cut_at=4)
    for f in range(4):
        assert torch.equal(frame(plain, f)[0], frame(cut, f)[0])
        assert scene_of(cut, f) == 0
    for f in (4, 5, 30):
        assert scene_of(cut, f) == 1
        assert not torch.equal(frame(plain, f)[0], frame(cut, f)[0])
    # across the cut the frame jumps far beyond a drift step
    jump = float((frame(cut, 4)[0] - frame(cut, 3)[0]).abs().max())
    assert jump > 10 * 1.5 * 0.05 * math.sqrt(2 * WAVES)
    # the second scene does not depend on where the cut is: cut_at=0 shows it from frame 0 on
    from_start = VideoSpec(size=16, features=3, seed=8, drift=0.05, cut_at=0)
    assert scene_of(from_start, 0) == 1
    assert torch.equal(frame(from_start, 9)[0], frame(cut, 9)[0])
    assert not torch.equal(frame(from_start, 2)[0], frame(cut, 2)[0])


def test_the_teacher_is_a_3x3_same_convolution_then_a_sigmoid():
    spec = VideoSpec(size=10, features=4, seed=9, drift=0.1)
    weight, bias = video._teacher(spec)
    x64 = video._scene_image(spec, 0, 3)
    expected = torch.sigmoid(2.0 * F.conv2d(x64[None], weight, bias, padding=1))  # torch's convolution: the oracle
    _, y = frame(spec, 3)
    torch.testing.assert_close(y, expected.to(torch.float32), rtol=0, atol=1e-6)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"size": 0, "features": 1}, "size must be an int >= 1, got 0"),
    ({"size": 4.0, "features": 1}, "size must be an int >= 1, got 4.0"),
    ({"size": 4, "features": 0}, "features must be an int >= 1, got 0"),
    ({"size": 4, "features": True}, "features must be an int >= 1, got True"),
    ({"size": 4, "features": 1, "seed": "a"}, "seed must be an int, got 'a'"),
    ({"size": 4, "features": 1, "drift": math.nan}, "drift must be a finite number of radians per frame, got nan"),
    ({"size": 4, "features": 1, "drift": math.inf}, "got inf"),
    ({"size": 4, "features": 1, "cut_at": -1}, "cut_at must be an int >= 0 or None, got -1"),
    ({"size": 4, "features": 1, "cut_at": 2.5}, "got 2.5"),
    ({"size": 4097, "features": 4096}, f"exceeds the limit of {MAX_FRAME_ELEMENTS}"),
])
def test_bad_values_are_a_spec_error_naming_them(kwargs, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        VideoSpec(**kwargs)


@pytest.mark.parametrize("f", [-1, 1.0, True])
def test_a_bad_frame_index_is_a_spec_error(f):
    with pytest.raises(SpecError, match=f"frame index must be an int >= 0, got {f!r}"):
        frame(VideoSpec(size=4, features=1), f)
