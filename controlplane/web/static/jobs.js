// The job list: every job the log holds, newest activity first, each linking to its page.
"use strict";

(() => {
  const { el, get, run, status, time, number, stateBadge } = Elastic;

  async function load() {
    const body = await get("/jobs");
    const jobs = Array.isArray(body) ? body : body.jobs || [];
    jobs.sort((a, b) => String(b.last_event_at || "").localeCompare(String(a.last_event_at || "")));
    const table = document.getElementById("jobs");
    const rows = jobs.map((job) => el(
      "tr", { dataset: { jobId: job.job_id } },
      el("td", {}, el("a", { href: "jobs/" + encodeURIComponent(job.job_id), text: job.name || job.job_id })),
      el("td", {}, stateBadge(job.state)),
      el("td", { class: "num", text: job.generation }),
      el("td", { class: "num", text: job.world_size }),
      el("td", { class: "num", text: job.last_step }),
      el("td", { class: "num", text: number(job.last_loss, 4) }),
      el("td", { class: "num", text: job.incidents + (job.open_incident ? " (1 open)" : "") }),
      el("td", { class: "num", text: job.events }),
      el("td", { text: time(job.last_event_at) }),
    ));
    table.tBodies[0].replaceChildren(...rows);
    table.hidden = jobs.length === 0;
    status(jobs.length ? "" : "No job in the log yet.");
  }

  run(load);
})();
