"""Test support that ships with the package: fault injection and randomized fault schedules, used by
the test suite, by `make soak`, and by operators who want to chaos-test their own deployment; and small
real tokenizers made on the spot (tokenizer_fixtures), used by the tests and the e2e model."""
