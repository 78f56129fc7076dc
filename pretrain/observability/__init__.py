"""What a run tells the people watching it: the Prometheus exporter (:mod:`.metrics`), the run's
event and metric logs (:mod:`.runlog`) and TensorBoard scalars (:mod:`.tensorboard_log`). Nothing
here decides anything about training; the trainer and the checkpoint manager report into it."""
