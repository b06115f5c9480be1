"""A speculative server's per-request draft counts: the record's against SGLang's meta_info, and what a draft
that proposes the last token again must get accepted (tests/e2e/test_speculative.py, test_model_family.py)."""


def check_steps(rec, meta):
    """The record's drafts accepted at each verify step are SGLang's for that request: as many steps as its verify
    passes, their sum its accepted drafts, their histogram its spec_correct_drafts_histogram."""
    steps = rec.meta["speculative"]["accepted_drafts"]
    histogram = [steps.count(k) for k in range(max(steps) + 1)] if steps else None
    assert (len(steps), sum(steps), histogram, rec.meta["speculative"]["verify_steps"]) == (
        meta["spec_verify_ct"], meta["spec_num_correct_drafts"], meta.get("spec_correct_drafts_histogram"),
        meta["spec_verify_ct"]), (rec.rid, steps, meta)


def repeat_draft_accepts(output_ids, steps):
    """(least, most) drafts a chain of `steps` drafts that each propose the last token again gets accepted, for
    this greedy output: each verify after the prefill's token accepts as many drafts as the next tokens repeat
    the last (at most `steps`), and emits them and one token more. Exact (least == most) unless the output ends
    inside the last verify's run: SGLang counts the drafts that verify accepted past max_new_tokens too."""
    i, accepted, run = 0, 0, 0
    while i + 1 < len(output_ids):
        run = 0
        while run < steps and i + run + 1 < len(output_ids) and output_ids[i + run + 1] == output_ids[i]:
            run += 1
        accepted += run
        i += run + 1
    open_end = i == len(output_ids) and run < steps  # the last run reached the end before `steps`
    return accepted, accepted + (steps - run if open_end else 0)
