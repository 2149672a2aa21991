"""``agentenv view``: a local web page for rollout files, eval reports and training runs.

``agentenv view PATH [PATH ...]`` serves the page on loopback and opens it in the browser:
a list of trajectories with filters, a group's samples side by side, one trajectory token by
token (sampled tokens told from inserted ones by their loss mask; logprob and weight version
on hover; a heat view), two runs compared task by task, a training run's curves, and a run
that is still writing, followed as it grows. :mod:`~agentenv.view.runs` reads the files,
:mod:`~agentenv.view.tokens` gives each token its text, :mod:`~agentenv.view.server` answers
the page's requests and :mod:`~agentenv.view.page` holds the page itself. Nothing else in the
package imports this one.
"""
