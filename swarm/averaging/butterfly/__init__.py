"""The butterfly all-reduce inside one agreed group: reduce-scatter, then all-gather.

- :mod:`~swarm.averaging.butterfly.parts`: who owns which slice of the flat vector (sans-I/O)
- :mod:`~swarm.averaging.butterfly.flat`: the round's tensors as one flat vector, and staging
- :mod:`~swarm.averaging.butterfly.residuals`: error feedback over slices of the flat vector
- :mod:`~swarm.averaging.butterfly.context`: what every side of one member's all-reduce shares
- :mod:`~swarm.averaging.butterfly.workers`: worker threads for tensor work off the event loop
- :mod:`~swarm.averaging.butterfly.sender`: a sender's side of one part (stream, stage the average)
- :mod:`~swarm.averaging.butterfly.owner`: an owner's side of one part (reduce, stream back)
- :mod:`~swarm.averaging.butterfly.intake`: what an owner receives, stalled senders dropped
- :mod:`~swarm.averaging.butterfly.replies`: what an owner streams back, then its verdict
- :mod:`~swarm.averaging.butterfly.reducer`: weighted reduction of one part (sans-I/O)
- :mod:`~swarm.averaging.butterfly.robust`: capped weights and CenteredClip (sans-I/O)
- :mod:`~swarm.averaging.butterfly.checks`: is an owner's average plausible? (sans-I/O)
- :mod:`~swarm.averaging.butterfly.stall`: when to give up on a silent sender (sans-I/O)
- :mod:`~swarm.averaging.butterfly.outcome`: how each part ends, and what each side reports
- :mod:`~swarm.averaging.butterfly.repair`: parts nobody averaged, averaged again (sans-I/O)
- :mod:`~swarm.averaging.butterfly.rounds`: which round an inbound part stream belongs to
- :mod:`~swarm.averaging.butterfly.allreduce`: one member's all-reduce over owner and senders
- :mod:`~swarm.averaging.butterfly.runner`: this peer's all-reduces: plans, staging, residuals,
  repairs, exclusions, and the route that serves part streams
"""
