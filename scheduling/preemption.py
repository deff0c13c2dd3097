def plan_preemptions(problem, book, pending):
    return ()
