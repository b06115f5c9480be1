"""The output ring as AdmissionControl sees it, for the admission unit tests: a capacity and free bytes
the test sets by hand."""


class Ring:
    """What AdmissionControl reads of the output ring: its capacity and its free bytes."""

    def __init__(self, capacity):
        self.capacity, self.free = capacity, capacity

    def free_bytes(self):
        return self.free
