// agentenv view: the runs being served (the full page follows in app.js's next revision).
fetch("/api/runs").then((r) => r.json()).then((runs) => {
  document.getElementById("main").textContent = runs.map((r) => `${r.label} (${r.kind})`).join(", ");
});
