-- wrk script: a minimal chat completion from a Guaranteed tenant (never shaped at idle).
wrk.method = "POST"
wrk.body = '{"model":"llama-3-70b","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["X-Tenant-ID"] = os.getenv("TENANT") or "support-bot"
