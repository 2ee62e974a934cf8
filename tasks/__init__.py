"""Pure stage logic (torch, pyarrow, transformers, datasets; never Prefect), installed as `kdflow.tasks`.

`common` is shared by every stage; `corpus` (materialise, tokenise), `teacher` (the top-K pass) and `student`
(training, chat) import `common` and `kdflow.schemas` only, never each other.
"""
