"""What the Python test scripts here share: a list of failures the checks add
to, and the runner of a script's test_* functions (names on the command line
select some)."""
import sys

failures = []


def run(namespace):
    tests = {name: fn for name, fn in namespace.items() if name.startswith("test_")}
    for name in sys.argv[1:] or list(tests):
        before = len(failures)
        try:
            tests[name]()
        except AssertionError as error:
            failures.append("%s: %s" % (name, error))
        print("%s %s" % ("PASS" if len(failures) == before else "FAIL", name), flush=True)
    for f in failures:
        print("FAILED:", f)
    sys.exit(1 if failures else 0)
