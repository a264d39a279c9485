"""``experiments.run faults_real``'s prediction of the crash case is the long run's exact structure: 16 iterations
and the 2 lost to the failure before iteration 10 (the checkpoint after 8 survives), 4 checkpoints, one restart."""

import pytest

from experiments.faults_real import predict_crash


@pytest.mark.parametrize("iteration_s, checkpoint_s, restart_s", [(1.0, 0.5, 3.0), (0.15, 0.09, 1.5)])
def test_the_crash_prediction_is_its_iterations_checkpoints_and_restart(iteration_s, checkpoint_s, restart_s):
    assert predict_crash(iteration_s, checkpoint_s, restart_s) == pytest.approx(
        (16 + 2) * iteration_s + 4 * checkpoint_s + restart_s)
