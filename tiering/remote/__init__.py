"""Tier 3: a run in an object store.

``objectstore`` is the store client (S3 through boto3, ``file://``) and ``store_faults`` its
deliberate faults; ``tier`` is :class:`RemoteTier`, which composes the four protocols that share
``run`` (a run's keys and their listing): ``lease`` (who may write the run), ``upload`` (a
published step, then COMMITTED, then the latest.json hint), ``download`` (verified ranged GETs
and the restore of the newest verified step) and ``gc`` (mark, then delete on a later pass);
``uploader`` is ``tiering upload``, the promotion loop. Never imports torch or ``pretrain``.
"""
