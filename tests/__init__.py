"""hubsoup's tests, in folders that mirror hubsoup's packages (tests/engine for hubsoup/engine, ...); here the
top-level modules' tests and the checks of the whole package. Each folder is a package (pytest's way for test
modules of the same name in different folders): a test module is ``tests.<folder>.test_x``, and one imports
another by that name. Helpers (hub_server, tiny_models, method_helpers, paths, ...) stay in this folder and are
imported by bare name (conftest puts this folder on ``sys.path``); helper scripts are run by path."""
