"""The table of reference operators: ops_<family>.py files register into it with @op."""
OPS = {}


def op(name):
    def register(fn):
        OPS[name] = fn
        return fn
    return register
