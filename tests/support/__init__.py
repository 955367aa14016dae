"""What the tests share: op counters and recording policies (``helpers``), the toy models and
manager spies of the swap tests (``swap_models``), the schedules run on the simulated device
(``sim_scenarios``) and the two-process scenarios of the distributed tests (``dist_utils``).

``tests/`` is on pytest's ``pythonpath`` (pyproject.toml), so tests import ``support.<module>``.
"""
