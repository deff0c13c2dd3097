def plan_defragmentation(problem, book, pending):
    return ()
