"""What a run is assembled from, below both training and evaluation: the policy (`policy.build_policy`),
its rollout engines and role call settings (`engines`), and the run directory's checkpoints (`layout`).

Training (`rolerl.train`) and evaluation (`rolerl.eval`) both build on this package; it imports neither,
so imports run one way: training uses evaluation, and evaluation uses neither training nor anything above
it (`tests/test_layers.py` checks it)."""
