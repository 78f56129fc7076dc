"""``pretrain soak``: random faults at random moments against a training job, measured against the
same job run without faults (schedule, injection, the run, the report)."""
