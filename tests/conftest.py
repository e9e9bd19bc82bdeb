import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# the distributed suites' tiers (tests_dist/tiers.py: CI runs what carries each claim, make test-full every case)
# serve these tests too; appended, so that a name here wins over one there
sys.path.append(os.path.join(os.path.dirname(__file__), os.pardir, "tests_dist"))
