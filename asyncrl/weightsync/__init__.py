"""Learner -> engine weight pushes: bucketing, transports, the version registry, atomic commit.

Modules: `bucket` (pack/unpack), `transport` (object store; selection by placement), `replicas`
(the generator's update interface as the publisher sees it), `registry` (versions, their state
machine and timeline), `push` (`Publisher.publish`, `WeightsyncError`,
`preserve_rng_state`), `metrics` (`weightsync/...` dicts).
"""
