"""Fault injection and randomized fault schedules, used by the test suite, by `make soak`, and by
operators who want to chaos-test their own deployment. Depends on both ``kvindex`` and
``workers_shim`` (the faults wrap the worker's ``Publisher``). Also small real tokenizers made on the
spot (``tokenizer_fixtures``, needing only ``tokenizers``), used by the tests and the e2e models."""
