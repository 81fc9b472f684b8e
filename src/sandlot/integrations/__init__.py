"""Front ends of sandlot inside other frameworks, each over the public ``Box`` facade and
imported only when used (its framework is an optional extra): ``openai_agents`` makes
sandlot a sandbox client of the OpenAI Agents SDK (``pip install 'sandlot[openai-agents]'``)."""
