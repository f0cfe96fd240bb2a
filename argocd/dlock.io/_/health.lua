-- Argo CD health for every dlock.io kind (argocd-cm `resource.customizations`, key
-- `dlock.io/*`), driven by the operator's conditions, never by phase strings: Degraded when
-- Degraded=True, Healthy when Ready=True, Suspended while the dlock.io/reconcile: paused
-- annotation is set, Progressing otherwise.
local hs = {}
local annotations = obj.metadata and obj.metadata.annotations
if annotations ~= nil and annotations["dlock.io/reconcile"] == "paused" then
  hs.status = "Suspended"
  hs.message = "Reconciliation is paused (dlock.io/reconcile: paused)"
  return hs
end
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report status"
  return hs
end
local generation = obj.metadata and obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and observed ~= nil and observed < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end
local ready = nil
local degraded = nil
local progressing = nil
for _, condition in ipairs(obj.status.conditions) do
  if condition.type == "Ready" then ready = condition end
  if condition.type == "Degraded" then degraded = condition end
  if condition.type == "Progressing" then progressing = condition end
end
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = degraded.message or degraded.reason or "Degraded"
  return hs
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or "Ready"
  return hs
end
hs.status = "Progressing"
if progressing ~= nil and progressing.message ~= nil and progressing.message ~= "" then
  hs.message = progressing.message
elseif ready ~= nil and ready.message ~= nil and ready.message ~= "" then
  hs.message = ready.message
else
  hs.message = "Progressing"
end
return hs
