"""Test support: the float64 NumPy references (:mod:`support.reference`), running a function
over simulated workers in each mapping (:mod:`support.mapping`), and the jobs the tests start
as subprocesses (``support/jobs``)."""
