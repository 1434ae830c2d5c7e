"""The n samples of one client request (vLLM's ParentRequest).

Each sample is a request of its own, with the group's id and its index. Only the first
is admitted at once; the others are deferred until it has its first token, so that its
prefill has cached the prompt's blocks and they find them in the prefix cache instead of
prefilling the prompt again.
"""

from dataclasses import dataclass

from replica.request import Request


@dataclass
class SampleGroup:
    request_id: str  # the caller's; each sample's is f"{request_id}#{index}"
    unfinished: set[str]  # the ids of the samples not yet finished, deferred ones included
    deferred: list[Request]  # admitted once the first sample has its first token

    @classmethod
    def of(cls, request_id: str, samples: list[Request]) -> "SampleGroup":
        return cls(request_id, {s.request_id for s in samples}, list(samples[1:]))

    def release_deferred(self) -> list[Request]:
        """The deferred samples, to admit now that the first one has its first token."""
        released, self.deferred = self.deferred, []
        return released

    def finish(self, sample: Request) -> bool:
        """Count the sample out; True once every sample has finished. Samples still
        deferred when the first one finishes (aborted before its first token) go with
        it: nothing would admit them."""
        self.unfinished.discard(sample.request_id)
        if sample.index == 0:
            self.unfinished.difference_update(s.request_id for s in self.release_deferred())
        return not self.unfinished
