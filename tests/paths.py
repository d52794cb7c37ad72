"""Where the tests are: the repository's root and this folder, for every test module wherever it sits
(tests/ mirrors hubsoup/'s packages; a module counting ``dirname``s of its own ``__file__`` breaks when it moves).
Imported by bare name, as every helper here: conftest puts this folder on ``sys.path``."""

import os

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
