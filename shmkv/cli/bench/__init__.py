"""``shmkv bench``: benchmarks against the alternatives, measured in the same run.

driver.py parses the options and prints the report; scenarios.py names the scenarios;
cases.py and cases_more.py measure them (prefix.py, remote.py and hf.py the larger ones).
Imported only by the ``bench`` command: ``import shmkv`` does not load it.
"""
